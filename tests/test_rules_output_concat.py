"""output-concat-to-host: `surgery fix` lifts a detector's decode tail to 4-D, which puts the
boxes ‖ scores Concat of the graph output on the MLA, one int8 tensor with one scale sized for
the boxes: every score quantized to zero. Run last, the rule pins that Concat to the host, so
each part leaves the MLA with its own scale; the segments stay one."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from compiler.quantize import quantize_model
from surgery.check import check_model
from surgery.coverage import PLACEMENT_METADATA_KEY
from surgery.rules.fix import fix_model
from surgery.rules.structure import output_concat_tails


def detector(extra_reader: bool = False) -> onnx.ModelProto:
    """A shared stem, then boxes (×300) and sigmoid scores concatenated along the channels
    and reshaped to the
    rank-3 output (what `fix` leaves of an Ultralytics head). `extra_reader`: the Concat also
    feeds a Conv, so it is not a tail."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 3, 1, 1)) * 300).astype(np.float32), "wa"),
        numpy_helper.from_array((rng.standard_normal((3, 3, 1, 1)) * 0.3).astype(np.float32), "wb"),
        numpy_helper.from_array(rng.standard_normal((2, 7, 1, 1)).astype(np.float32), "wc"),
        numpy_helper.from_array(rng.standard_normal((3, 3, 1, 1)).astype(np.float32), "ws"),
        numpy_helper.from_array(np.array([1, 7, 64], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "ws"], ["stem"], name="stem_conv"),
        helper.make_node("Conv", ["stem", "wa"], ["boxes"], name="box_conv"),
        helper.make_node("Conv", ["stem", "wb"], ["logits"], name="score_conv"),
        helper.make_node("Sigmoid", ["logits"], ["scores"], name="score_sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["head"], name="head", axis=1),
        helper.make_node("Reshape", ["head", "shape"], ["output0"], name="flat"),
    ]
    outputs = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 7, 64])]
    if extra_reader:
        nodes.append(helper.make_node("Conv", ["head", "wc"], ["more"], name="more_conv"))
        outputs.append(helper.make_tensor_value_info("more", TensorProto.FLOAT, [1, 2, 8, 8]))
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _pins(model: onnx.ModelProto) -> dict[str, str]:
    props = {p.key: p.value for p in model.metadata_props}
    return json.loads(props.get(PLACEMENT_METADATA_KEY, "{}"))


def _score_error(model: onnx.ModelProto, samples: list[np.ndarray]) -> float:
    """Max abs error of the scores slice of output0 after int8 quantization."""
    qdq = quantize_model(model, samples[:4]).model
    float_run = ort.InferenceSession(model.SerializeToString())
    quant_run = ort.InferenceSession(qdq.SerializeToString())
    worst = 0.0
    for x in samples[4:]:
        ref = float_run.run(["output0"], {"x": x})[0][:, 4:]
        got = quant_run.run(["output0"], {"x": x})[0][:, 4:]
        worst = max(worst, float(np.abs(ref - got).max()))
    return worst


def test_fix_concatenates_the_output_on_the_host(samples) -> None:
    model = detector()
    result = fix_model(model, "mlsoc")
    assert [s["rule"] for s in result.steps][-1] == "output-concat-to-host"
    assert result.single_elf
    assert _pins(result.model) == {"head": "CVU"}
    assert check_model(result.model, "mlsoc", suggest=False).mla_segments == 1
    assert _score_error(result.model, samples) < 0.05  # each part has its own scale …
    assert _score_error(model, samples) > 0.3  # … where the Concat on the MLA rounds them away


def test_a_concat_read_inside_the_network_stays_on_the_mla() -> None:
    model = detector(extra_reader=True)
    coverage = check_model(model, "mlsoc", suggest=False)
    assert output_concat_tails(coverage, model) == []
    result = fix_model(model, "mlsoc")
    assert "output-concat-to-host" not in [s["rule"] for s in result.steps]


def test_parts_without_a_shared_body_keep_the_concat_on_the_mla() -> None:
    """Two branches from the input meet only in the Concat: on the host it would leave two
    MLA segments, so fix keeps it."""
    model = detector()
    for node in model.graph.node:
        if node.name in ("box_conv", "score_conv"):
            node.input[0] = "x"
    model.graph.node.remove(next(n for n in model.graph.node if n.name == "stem_conv"))
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 1
    result = fix_model(model, "mlsoc")
    assert "output-concat-to-host" not in [s["rule"] for s in result.steps]
    assert {"rule": "output-concat-to-host", "reason": "would add an MLA segment"} in (
        result.rejected
    )


def test_fix_can_skip_it() -> None:
    result = fix_model(detector(), "mlsoc", skip=["output-concat-to-host"])
    assert "output-concat-to-host" not in [s["rule"] for s in result.steps]
    assert _pins(result.model) == {}


def test_check_suggests_no_rule_for_the_pinned_concat() -> None:
    """No rule undoes a pin: check of the fixed model lists the Concat as pinned, with no fix
    (it used to suggest cut-postprocess)."""
    fixed = fix_model(detector(), "mlsoc").model
    (pinned,) = [b for b in check_model(fixed, "mlsoc").blockers if b.name == "head"]
    assert pinned.reasons[0].code == "pinned"
    assert pinned.suggested_rules == []


def test_the_step_line_says_the_added_blocker_is_a_pin() -> None:
    """blockers 1→2 would read as a regression; the pin is the step's purpose."""
    from surgery.rules.fix import describe_step

    step = fix_model(detector(), "mlsoc").steps[-1]
    assert step["pinned_after"] == 1
    assert describe_step(step).endswith("(1 pinned to the host)")
