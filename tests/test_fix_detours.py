"""`surgery fix` takes a rewrite that splits a segment when it removes blockers and fixing on
from it ends better — only once no step improves coverage directly."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.fix import fix_model

SEQ, HIDDEN, FFN = 16, 32, 8


def _layer(
    k: int, x: str, rng: np.random.Generator, inits: list, heavy: bool = True
) -> tuple[list, str]:
    """Rank-3 tokens → a 4-D island (3×1 Conv, Softmax) holding most of the MACs → MatMul →
    tanh-GELU with Pow(h, 3) → MatMul."""

    def weight(name: str, shape: tuple[int, ...]) -> str:
        inits.append(
            numpy_helper.from_array(rng.normal(0, 0.2, shape).astype(np.float32), f"{name}{k}")
        )
        return f"{name}{k}"

    def t(name: str) -> str:
        return f"{name}{k}"

    n = helper.make_node
    w1, b1 = weight("w1", (HIDDEN, FFN)), weight("b1", (FFN,))
    w2, b2 = weight("w2", (FFN, HIDDEN)), weight("b2", (HIDDEN,))
    wc = weight("wc", (SEQ, SEQ, 3, 1))
    nodes = [
        n("Reshape", [x, "to4d"], [t("x4")]),
        n("Conv", [t("x4"), wc], [t("c4")], pads=[1, 0, 1, 0])
        if heavy
        else n("Identity", [t("x4")], [t("c4")]),
        n("Softmax", [t("c4")], [t("sm")], axis=2),
        n("Reshape", [t("sm"), "to3d"], [t("a")]),
        n("Add", [t("a"), x], [t("ax")]),
        n("MatMul", [t("ax"), w1], [t("h0")]),
        n("Add", [t("h0"), b1], [t("h")]),
        n("Pow", [t("h"), "three"], [t("h3")]),
        n("Mul", [t("h3"), "c"], [t("h3c")]),
        n("Add", [t("h"), t("h3c")], [t("inner")]),
        n("Mul", [t("inner"), "root"], [t("scaled")]),
        n("Tanh", [t("scaled")], [t("tanh")]),
        n("Add", [t("tanh"), "one"], [t("gate")]),
        n("Mul", [t("h"), "half"], [t("hh")]),
        n("Mul", [t("hh"), t("gate")], [t("gelu")]),
        n("MatMul", [t("gelu"), w2], [t("o")]),
        n("Add", [t("o"), b2], [t("y")]),
    ]
    return nodes, t("y")


def _two_albert_like_layers(heavy_islands: bool = True) -> onnx.ModelProto:
    """Before lifting to 4-D, the two Conv/Softmax islands are two segments on rk3588 with
    three quarters of the MACs; lifting leaves the two Pow(h, 3) between three; pow2-to-mul
    then joins them into one."""
    rng = np.random.default_rng(0)

    def scalar(name: str, value: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(value, np.float32), name)

    inits = [
        scalar("three", 3.0),
        scalar("c", 0.044715),
        scalar("root", 0.7978845608),
        scalar("one", 1.0),
        scalar("half", 0.5),
        numpy_helper.from_array(np.array([1, SEQ, HIDDEN, 1], np.int64), "to4d"),
        numpy_helper.from_array(np.array([1, SEQ, HIDDEN], np.int64), "to3d"),
    ]
    nodes, x = [], "x"
    for k in range(2):
        layer, x = _layer(k, x, rng, inits, heavy_islands)
        nodes += layer
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes,
        "two_layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_fix_takes_a_lift_that_splits_a_segment_on_the_way_to_one() -> None:
    result = fix_model(_two_albert_like_layers(), "rk3588")
    rules = [step["rule"] for step in result.steps]
    assert rules[-2:] == ["transformer-to-4d", "pow2-to-mul"]
    assert result.coverage_after.mla_segments == 1
    assert all(step["verify"]["passed"] for step in result.steps)


def test_fix_without_look_ahead_keeps_the_two_islands() -> None:
    model = _two_albert_like_layers()
    result = fix_model(model, "rk3588", look_ahead=False)
    assert "transformer-to-4d" not in [step["rule"] for step in result.steps]
    assert result.coverage_after.mla_segments == check_model(result.model, "rk3588").mla_segments
    assert result.coverage_after.mla_segments == 2


def test_islands_with_few_macs_do_not_outrank_a_lift_that_moves_them_all() -> None:
    """Without the Convs the two islands hold almost no MACs: two segments there are a model
    that runs on the host, and the lift (three segments, every MAC on the MLA) is kept
    outright, with no look-ahead."""
    model = _two_albert_like_layers(heavy_islands=False)
    before = check_model(model, "rk3588")
    assert before.mla_segments == 2 and before.mla_mac_fraction < 0.5
    result = fix_model(model, "rk3588", look_ahead=False)
    assert "transformer-to-4d" in [step["rule"] for step in result.steps]
    assert result.coverage_after.mla_mac_fraction == 1.0
