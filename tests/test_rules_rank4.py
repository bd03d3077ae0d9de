"""The reshape-to-4d family: layouts, per-op lifts, the three rules, and real models (slow)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.coverage import analyze_coverage
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules import rank4_layout as L
from surgery.rules.engine import RewriteResult
from surgery.rules.fix import fix_model
from tests.conftest import RUN_INPUTS, shared_model
from tests.lower_support import quantize_on, run_and_compare

RULES = ("reshape-to-4d", "classifier-to-conv", "transformer-to-4d")


# ---------------------------------------------------------------------- helpers


class Net:
    """A tiny onnx.helper graph builder with seeded weights (fixtures for single patterns)."""

    def __init__(self, opset: int = 17, seed: int = 0) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, value) -> str:
        name = self._name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def rand(self, *shape: int) -> str:
        return self.const(self.rng.standard_normal(shape).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str]:
        name = self._name(op_type.lower())
        outs = [f"{name}_y{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, **attrs)[0]

    def conv(self, x: str, cin: int, cout: int, k: int = 1, stride: int = 1) -> str:
        w = self.const(
            (self.rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        )
        return self.one(
            "Conv", [x, w], kernel_shape=[k, k], strides=[stride] * 2, pads=[k // 2] * 4
        )

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.one("Reshape", [x, self.const(np.array(shape, np.int64))])

    def model(self, inputs: dict[str, list[int]], outputs: dict[str, str]) -> onnx.ModelProto:
        for name, tensor in outputs.items():
            for node in self.nodes:
                for k, out in enumerate(node.output):
                    if out == tensor:
                        node.output[k] = name
        graph = helper.make_graph(
            self.nodes,
            "net",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        known = {o.name: o for o in inferred.graph.output}
        for out in model.graph.output:
            out.type.CopyFrom(known[out.name].type)
        return load_model(model)


def _output_signature(model: onnx.ModelProto) -> list[tuple[str, list[int]]]:
    return [
        (o.name, [d.dim_value for d in o.type.tensor_type.shape.dim]) for o in model.graph.output
    ]


def lift(model: onnx.ModelProto, rule: str) -> RewriteResult:
    """Apply a rank-4 rule and check the invariants every application must keep."""
    result = apply_rule(model, rule)
    ver = result.verification
    assert ver.passed and ver.mode == "exact"
    for out in ver.outputs:
        assert out.max_abs is not None and (out.max_abs <= 1e-5 or out.max_rel <= 1e-5)
    assert _output_signature(result.model) == _output_signature(load_model(model))
    assert len(result.coverage_after.blockers) < len(result.coverage_before.blockers)
    return result


def on_mla(result: RewriteResult, names: list[str]) -> None:
    """Each named original node, where it still exists, now runs on the MLA."""
    placed = {p.name: p.processor for p in result.coverage_after.placements}
    present = [n for n in names if n in placed]
    assert present, "none of the lifted nodes kept its name"
    assert {n: placed[n] for n in present} == dict.fromkeys(present, "MLA")


def rules_matching(model: onnx.ModelProto) -> set[str]:
    return {r for r in RULES if find_matches(model, r)}


# ---------------------------------------------------------------------- layouts


def _form(x: np.ndarray, layout: L.Layout | None) -> np.ndarray:
    return x if layout is None else x.transpose(layout.order).reshape(layout.shape4(x.shape))


def _run_steps(x: np.ndarray, steps: list[L.Step]) -> np.ndarray:
    for kind, arg in steps:
        x = x.reshape(arg) if kind == "Reshape" else x.transpose(arg)
    return x


def _layouts(rank: int):
    """Every way to put `rank` axes, in some order, into 4 slots (consecutive runs)."""
    for order in itertools.permutations(range(rank)):
        for cuts in itertools.combinations_with_replacement(range(rank + 1), 3):
            bounds = (0, *cuts, rank)
            yield L.Layout(tuple(tuple(order[bounds[k] : bounds[k + 1]]) for k in range(4)))


@pytest.mark.parametrize("shape", [(1, 6, 5), (2, 3, 4), (1, 1, 7), (3, 5), (1, 2, 3, 4)])
def test_steps_between_layouts_reproduce_the_target_form(shape):
    x = np.arange(np.prod(shape)).reshape(shape)
    layouts = list(_layouts(len(shape)))
    rng = np.random.default_rng(len(layouts))
    sample = [layouts[k] for k in rng.choice(len(layouts), min(40, len(layouts)), replace=False)]
    for src, dst in itertools.product([None, *sample], [None, *sample[::-1]]):
        steps = L.steps_between(shape, src, dst)
        assert len(steps) <= 3
        got = _run_steps(_form(x, src), steps)
        np.testing.assert_array_equal(got, _form(x, dst))
        for kind, arg in steps:
            if kind == "Transpose" and sum(d != 1 for d in shape) <= 3:
                assert arg[0] == 0, "the batch axis stays in place"


def test_layout_helpers():
    assert L.ncl(3).shape4((1, 84, 8400)) == (1, 84, 1, 8400)
    assert L.rows(3).shape4((1, 197, 192)) == (197, 192, 1, 1)
    assert L.spread((1, 3, 85, 80, 80)).shape4((1, 3, 85, 80, 80)) == (3, 85, 80, 80)
    assert L.spread((1, 2, 3, 4, 5, 6)) is None
    assert L.matmul(3).shape4((3, 197, 64)) == (1, 3, 197, 64)
    nlc = L.ncl(3).permuted((0, 2, 1))
    assert nlc.shape4((1, 196, 192)) == (1, 192, 1, 196)
    assert not nlc.is_plain((1, 196, 192))
    # a reshape that only drops unit axes keeps the data where it is
    relabeled = L.relabel_reshape(L.identity(), (1, 1280, 1, 1), (1, 1280))
    assert relabeled is not None and relabeled.shape4((1, 1280)) == (1, 1280, 1, 1)
    assert L.relabel_reshape(L.ncl(3), (1, 64, 8400), (1, 4, 16, 8400)) is None


def test_window_partition_moves_as_four_blocks():
    shape = (1, 2, 4, 2, 4, 8)  # [1, nH, h, nW, w, C]
    perm = (0, 1, 3, 2, 4, 5)
    runs = L.transpose_runs(shape, perm)
    assert runs is not None and runs.shape4(shape) == (2, 4, 2, 32)
    moved = runs.permuted(perm)  # the Transpose itself moves no data: same 4-D tensor
    out_shape = tuple(shape[p] for p in perm)
    x = np.arange(np.prod(shape)).reshape(shape)
    np.testing.assert_array_equal(_form(x.transpose(perm), moved), _form(x, runs))
    steps = L.steps_between(out_shape, moved, None)
    assert steps == [("Transpose", (0, 2, 1, 3)), ("Reshape", out_shape)]
    np.testing.assert_array_equal(_run_steps(_form(x, runs), steps), x.transpose(perm))
    assert L.transpose_runs((2, 3, 4, 5, 6), (4, 3, 2, 1, 0)) is None
    plain = L.plain_slots(moved, out_shape)
    assert plain is not None and plain.is_plain(out_shape)


def test_relayout_constant_broadcasts_like_the_original():
    from surgery.rules.rank4_lift import relayout_constant

    rng = np.random.default_rng(0)
    shape = (2, 3, 4)
    x = rng.standard_normal(shape)
    for const_shape in [(4,), (3, 1), (1, 3, 4), (2, 1, 1), ()]:
        c = rng.standard_normal(const_shape)
        for layout in list(_layouts(3))[::11]:
            got = _form(x, layout) + relayout_constant(c, layout, shape)
            np.testing.assert_allclose(got, _form(x + c, layout))


# ---------------------------------------------------------------------- reshape-to-4d (NCL)


def test_yolo_head_fixture_lifts_to_one_region(yolo_head):
    model = load_model(yolo_head)
    matches = find_matches(model, "reshape-to-4d")
    assert len(matches) == 1
    assert {"Reshape", "Concat", "Split", "Sigmoid"} <= {
        n.op_type for n in model.graph.node if n.name in matches[0].nodes
    }
    result = lift(model, "reshape-to-4d")
    after = result.coverage_after
    assert after.single_elf
    assert [b.op_type for b in after.blockers] == ["Reshape"]  # the trailing output reshape
    assert after.blockers[0].name.startswith("output0")


def test_no_match_where_everything_is_already_4d(plain_cnn, cnn_with_topk):
    assert rules_matching(load_model(plain_cnn)) == set()
    assert rules_matching(load_model(cnn_with_topk)) == set()


def test_detection_head_is_not_claimed_by_the_other_rules(yolo_head, yolov5_head):
    assert rules_matching(load_model(yolo_head)) == {"reshape-to-4d"}
    assert rules_matching(load_model(yolov5_head)) == {"reshape-to-4d"}


def _yolov8_head(anchors_per_level=(16, 8), classes: int = 3, reg: int = 16) -> onnx.ModelProto:
    """YOLOv8 head: per-level box/cls convs, flattened concat, DFL, dist2bbox with anchors."""
    n = Net()
    x = n.conv("images", 3, 8, k=3, stride=2)
    levels = [n.conv(x, 8, 16, k=3, stride=2)]
    levels.append(n.conv(levels[0], 16, 16, k=3, stride=2))
    boxes, scores = [], []
    for level in levels:
        boxes.append(n.reshape(n.conv(level, 16, 4 * reg), [1, 4 * reg, -1]))
        scores.append(n.reshape(n.conv(level, 16, classes), [1, classes, -1]))
    total = sum(hw * hw for hw in anchors_per_level)
    box = n.one("Concat", boxes, axis=-1)
    cls = n.one("Sigmoid", [n.one("Concat", scores, axis=-1)])
    d = n.reshape(box, [1, 4, reg, total])
    d = n.one("Softmax", [n.one("Transpose", [d], perm=[0, 2, 1, 3])], axis=1)
    proj = n.const(np.arange(reg, dtype=np.float32).reshape(1, reg, 1, 1))
    d = n.reshape(n.one("Conv", [d, proj]), [1, 4, total])
    two, four = n.const(np.array([2], np.int64)), n.const(np.array([4], np.int64))
    zero, one = n.const(np.array([0], np.int64)), n.const(np.array([1], np.int64))
    lt = n.one("Slice", [d, zero, two, one])
    rb = n.one("Slice", [d, two, four, one])
    anchors = n.const(np.random.default_rng(1).uniform(0, 8, (1, 2, total)).astype(np.float32))
    x1y1 = n.one("Sub", [anchors, lt])
    x2y2 = n.one("Add", [anchors, rb])
    centre = n.one("Div", [n.one("Add", [x1y1, x2y2]), n.const(np.float32(2))])
    wh = n.one("Sub", [x2y2, x1y1])
    strides = n.const(
        np.concatenate([np.full(hw * hw, 64 // hw, np.float32) for hw in anchors_per_level])[None]
    )
    xywh = n.one("Mul", [n.one("Concat", [centre, wh], axis=1), strides])
    out = n.one("Concat", [xywh, cls], axis=1)
    return n.model({"images": [1, 3, 64, 64]}, {"output0": out})


def test_yolov8_dfl_and_dist2bbox_end_up_on_the_mla():
    model = _yolov8_head()
    before = analyze_coverage(model)
    assert before.mla_segments >= 2
    result = lift(model, "reshape-to-4d")
    assert result.coverage_after.single_elf
    lifted = [
        n.name
        for n in model.graph.node
        if n.op_type in ("Softmax", "Slice", "Sub", "Add", "Div", "Mul", "Concat", "Sigmoid")
    ]
    on_mla(result, lifted)
    assert len(result.coverage_after.blockers) == 1


def test_rank5_anchor_head_is_carried_as_4d(yolov5_head):
    result = lift(load_model(yolov5_head), "reshape-to-4d")
    op_types = {n.op_type for n in result.model.graph.node}
    assert "Transpose" in op_types  # the channel-last permute, now 4-D on the MLA
    assert [b.op_type for b in result.coverage_after.blockers] == ["Reshape"]


def _sandwich(body, opset: int = 17, channels: int = 8) -> onnx.ModelProto:
    """conv → Reshape to [1,C,L] → body → output; the body is what the rule must lift."""
    n = Net(opset)
    x = n.conv("x", 3, channels)
    flat = n.reshape(x, [1, channels, 24])
    return n.model({"x": [1, 3, 4, 6]}, body(n, flat))


def _elementwise(n: Net, x: str) -> dict[str, str]:
    y = n.one("Sigmoid", [x])
    y = n.one("Mul", [y, n.rand(8, 1)])
    y = n.one("Add", [y, n.rand(24)])
    y = n.one("Div", [y, n.const(np.float32(3))])
    y = n.one("Pow", [y, n.const(np.float32(2))])
    y = n.one("Clip", [y, n.const(np.float32(0)), n.const(np.float32(0.5))])
    return {"y": y}


def _concat_split(n: Net, x: str) -> dict[str, str]:
    c = n.one("Concat", [x, n.rand(1, 2, 24)], axis=1)
    a, b = n.op("Split", [c, n.const(np.array([4, 6], np.int64))], n_out=2, axis=1)
    return {"a": a, "b": n.one("Sigmoid", [b])}


def _slice_gather(n: Net, x: str) -> dict[str, str]:
    s = n.one(
        "Slice",
        [
            x,
            n.const(np.array([1], np.int64)),
            n.const(np.array([20], np.int64)),
            n.const(np.array([-1], np.int64)),
            n.const(np.array([2], np.int64)),
        ],
    )
    g = n.one("Gather", [s, n.const(np.array(3, np.int64))], axis=1)
    r = n.one("Gather", [s, n.const(np.array([2, 3, 4], np.int64))], axis=1)
    return {"g": n.one("Relu", [g]), "r": n.one("Relu", [r])}


def _softmax_old(n: Net, x: str) -> dict[str, str]:
    return {"y": n.one("Softmax", [x], axis=1)}


def _softmax_last(n: Net, x: str) -> dict[str, str]:
    return {"y": n.one("Sigmoid", [n.one("Softmax", [x], axis=-1)])}


def _reduce(n: Net, x: str) -> dict[str, str]:
    m = n.one("ReduceMean", [x], axes=[2], keepdims=1)
    return {"m": n.one("Mul", [m, n.const(np.float32(2))])}


def _reduce_input_axes(n: Net, x: str) -> dict[str, str]:
    s = n.one("ReduceMax", [x, n.const(np.array([-1], np.int64))], keepdims=0)
    return {"s": n.one("Sigmoid", [s])}


def _transpose_unsqueeze(n: Net, x: str) -> dict[str, str]:
    t = n.one("Sigmoid", [n.one("Transpose", [x], perm=[0, 2, 1])])
    t = n.one("Transpose", [t], perm=[0, 2, 1])
    u = n.one("Unsqueeze", [t, n.const(np.array([2], np.int64))])
    return {"y": n.conv(u, 8, 4)}


def _conv1d(n: Net, x: str) -> dict[str, str]:
    w = n.const((n.rng.standard_normal((4, 8, 3)) / 5).astype(np.float32))
    y = n.one("Conv", [x, w, n.rand(4)], kernel_shape=[3], strides=[2], pads=[1, 1])
    bn = [n.const(np.abs(n.rng.standard_normal(4)).astype(np.float32) + 0.5) for _ in range(4)]
    y = n.one("BatchNormalization", [y, *bn])
    y = n.one("MaxPool", [n.one("Relu", [y])], kernel_shape=[2], strides=[2])
    return {"y": n.one("GlobalAveragePool", [y])}


def _pad_zero(n: Net, x: str) -> dict[str, str]:
    padded = n.one("Pad", [x, n.const(np.array([0, 0, 2, 0, 0, 1], np.int64))])
    return {"y": n.one("Sigmoid", [padded])}


NCL_CASES = {
    "elementwise": (_elementwise, 17),
    "concat_split": (_concat_split, 17),
    "slice_gather": (_slice_gather, 17),
    "softmax_opset11": (_softmax_old, 11),
    "softmax_last_axis": (_softmax_last, 17),
    "reduce_attr_axes": (_reduce, 13),
    "reduce_input_axes": (_reduce_input_axes, 18),
    "transpose_unsqueeze": (_transpose_unsqueeze, 17),
    "conv1d_bn_pool": (_conv1d, 17),
    "pad_zero": (_pad_zero, 17),
}


@pytest.mark.parametrize("case", sorted(NCL_CASES))
def test_reshape_to_4d_lifts_each_op_family_exactly(case):
    body, opset = NCL_CASES[case]
    model = _sandwich(body, opset)
    assert rules_matching(model) == {"reshape-to-4d"}
    result = lift(model, "reshape-to-4d")
    body = [n.name for n in model.graph.node[2:]]  # after the stem conv and the flattening
    on_mla(result, body)
    assert result.coverage_after.single_elf


def test_reflect_padded_conv1d_fixes_to_one_segment():
    """encodec / HiFi-GAN: a reflect Pad of [N,C,L] before each 1-D conv. Lifted, it is a Pad
    of W, which pad-to-slices spells with Slices the MLA runs."""
    n = Net()
    flat = n.reshape(n.conv("x", 3, 8), [1, 8, 24])
    padded = n.one("Pad", [flat, n.const(np.array([0, 0, 3, 0, 0, 3], np.int64))], mode="reflect")
    w = n.const((n.rng.standard_normal((4, 8, 7)) / 8).astype(np.float32))
    y = n.one("Conv", [padded, w], kernel_shape=[7])
    model = n.model({"x": [1, 3, 4, 6]}, {"y": n.conv(n.reshape(y, [1, 4, 4, 6]), 4, 4)})
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    result = fix_model(model, "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    assert "pad-to-slices" in [step["rule"] for step in result.steps]


def test_region_stops_at_ops_it_cannot_lift():
    def body(n: Net, x: str) -> dict[str, str]:
        s = n.one("Sigmoid", [x])
        values, _ = n.op("TopK", [s, n.const(np.array([5], np.int64))], n_out=2, axis=2)
        return {"y": n.one("Sigmoid", [values])}

    model = _sandwich(body)
    result = lift(model, "reshape-to-4d")
    topk = next(p for p in result.coverage_after.placements if p.op_type == "TopK")
    assert topk.processor != "MLA"


def _per_head_gate() -> onnx.ModelProto:
    """YOLO-World's max-sigmoid attention: features split into heads [1,h,c,H,W] times a
    per-head gate [1,h,1,H,W], both computed at run time, then merged back to [1,C,H,W]."""
    n = Net()
    x = n.conv("x", 3, 8)
    heads = n.reshape(x, [1, 2, 4, 4, 6])
    gate = n.one("Sigmoid", [n.conv(x, 8, 2)])
    gate = n.one("Unsqueeze", [gate, n.const(np.array([2], np.int64))])
    y = n.reshape(n.one("Mul", [heads, gate]), [1, 8, 4, 6])
    return n.model({"x": [1, 3, 4, 6]}, {"y": n.conv(y, 8, 4)})


def test_broadcast_between_two_run_time_operands_stays_a_4d_broadcast():
    model = _per_head_gate()
    result = lift(model, "reshape-to-4d")
    mul = next(p for p in result.coverage_after.placements if p.op_type == "Mul")
    assert mul.processor == "MLA"
    assert result.coverage_after.single_elf


@pytest.mark.parametrize("weight_rank", [2, 3])
def test_constant_matrix_times_a_flattened_map_becomes_a_1x1_conv(weight_rank):
    """W · x (YOLO-World's contrastive head: text embeddings [1,K,C] times features [1,C,H·W])."""
    n = Net()
    x = n.conv("x", 3, 8)
    w = n.rand(*(1,) * (weight_rank - 2), 5, 8)
    y = n.one("MatMul", [w, n.reshape(x, [1, 8, 24])])
    model = n.model({"x": [1, 3, 4, 6]}, {"y": n.conv(n.reshape(y, [1, 5, 4, 6]), 5, 4)})
    assert rules_matching(model) == {"reshape-to-4d"}
    result = lift(model, "reshape-to-4d")
    assert "MatMul" not in {node.op_type for node in result.model.graph.node}
    assert result.coverage_after.single_elf


def _constant_queries_attention() -> onnx.ModelProto:
    """DETR's first decoder layer: its queries are learned constants, so the cross-attention
    scores are a constant [heads, queries, d] times run-time keys [heads, d, tokens]."""
    n = Net()
    x = n.conv("x", 3, 8)
    keys = n.reshape(x, [2, 4, 24])  # heads × d × tokens
    queries = n.rand(2, 5, 4)
    scores = n.one("Softmax", [n.one("MatMul", [queries, keys])], axis=-1)
    y = n.reshape(scores, [1, 10, 4, 6])
    return n.model({"x": [1, 3, 4, 6]}, {"y": n.conv(y, 10, 4)})


def test_constant_batch_times_a_run_time_batch_is_one_4d_matmul():
    result = lift(_constant_queries_attention(), "reshape-to-4d")
    (matmul,) = [p for p in result.coverage_after.placements if p.op_type == "MatMul"]
    assert matmul.processor == "MLA"
    assert result.coverage_after.single_elf


def test_a_constant_batch_product_compiles_to_one_bit_exact_elf(tmp_path):
    fixed = fix_model(_constant_queries_attention(), "mlsoc").model
    qdq = quantize_on(fixed, "mlsoc")
    compiled = compile_model(qdq, tmp_path, target="mlsoc", model_name="constant_queries")
    assert len(compiled.elf_files) == 1, compiled.notes
    feed = {"x": np.random.default_rng(4).normal(0, 1, (1, 3, 4, 6)).astype(np.float32)}
    comparison = run_and_compare(compiled, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


# ---------------------------------------------------------------------- classifier-to-conv


def _gemm_classifier() -> onnx.ModelProto:
    n = Net()
    x = n.one("GlobalAveragePool", [n.conv("x", 3, 16, k=3)])
    flat = n.one("Flatten", [x], axis=1)
    logits = n.one("Gemm", [flat, n.rand(10, 16), n.rand(10)], transB=1, alpha=0.5, beta=2.0)
    return n.model({"x": [1, 3, 8, 8]}, {"probs": n.one("Softmax", [logits], axis=1)})


def _matmul_classifier() -> onnx.ModelProto:
    n = Net(opset=11)
    x = n.one("GlobalAveragePool", [n.conv("x", 3, 16, k=3)])
    flat = n.reshape(x, [1, 16])
    y = n.one("Add", [n.one("MatMul", [flat, n.rand(16, 2)]), n.rand(2)])
    y = n.one("Identity", [n.one("Softmax", [y], axis=1)])
    return n.model({"x": [1, 3, 8, 8]}, {"probs": y})


@pytest.mark.parametrize("build", [_gemm_classifier, _matmul_classifier])
def test_classifier_head_becomes_a_1x1_conv(build):
    model = build()
    assert rules_matching(model) == {"classifier-to-conv"}
    result = lift(model, "classifier-to-conv")
    ops = [n.op_type for n in result.model.graph.node]
    assert "Gemm" not in ops and "MatMul" not in ops and "Flatten" not in ops
    assert [b.op_type for b in result.coverage_after.blockers] == ["Reshape"]
    softmax = next(n for n in result.model.graph.node if n.op_type == "Softmax")
    assert helper.get_attribute_value(softmax.attribute[0]) == 1


# ---------------------------------------------------------------------- transformer-to-4d


def test_transformer_block_maps_to_one_segment(transformer_block):
    model = load_model(transformer_block)
    assert analyze_coverage(model).mla_segments > 1
    assert "transformer-to-4d" in rules_matching(model)
    result = lift(model, "transformer-to-4d")
    after = result.coverage_after
    assert after.single_elf
    ops = {n.op_type for n in result.model.graph.node}
    assert "Conv" in ops  # the linear layers
    for node in result.model.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax"):
            axis = next(a.i for a in node.attribute if a.name == "axis")
            assert axis == 1
    # only the entry (rank-3 graph input) and exit (rank-3 graph output) reshapes stay off
    assert sorted(b.op_type for b in after.blockers) == ["Reshape", "Reshape"]


def _mini_vit(dim: int = 16, heads: int = 2, classes: int = 5) -> onnx.ModelProto:
    """A ViT in miniature: patch conv, class token, rank-5 qkv split, Gather of the cls token."""
    n = Net()
    tokens, hd = 17, dim // heads
    p = n.one("Conv", ["input", n.rand(dim, 3, 4, 4)], kernel_shape=[4, 4], strides=[4, 4])
    t = n.one("Transpose", [n.reshape(p, [1, dim, 16])], perm=[0, 2, 1])
    t = n.one("Concat", [n.rand(1, 1, dim), t], axis=1)
    x = n.one("Add", [t, n.rand(1, tokens, dim)])
    ones, zeros = n.const(np.ones(dim, np.float32)), n.const(np.zeros(dim, np.float32))
    h = n.one("LayerNormalization", [x, ones, zeros], axis=-1)
    qkv = n.one("Add", [n.rand(3 * dim), n.one("MatMul", [h, n.rand(dim, 3 * dim)])])
    qkv = n.one("Transpose", [n.reshape(qkv, [1, tokens, 3, heads, hd])], perm=[2, 0, 3, 1, 4])
    parts = n.op("Split", [qkv, n.const(np.array([1, 1, 1], np.int64))], n_out=3, axis=0)
    q, k, v = (n.one("Squeeze", [s, n.const(np.array([0], np.int64))]) for s in parts)
    scores = n.one("MatMul", [q, n.one("Transpose", [k], perm=[0, 1, 3, 2])])
    att = n.one("Softmax", [n.one("Mul", [scores, n.const(np.float32(hd**-0.5))])], axis=-1)
    ctx = n.one("Transpose", [n.one("MatMul", [att, v])], perm=[0, 2, 1, 3])
    x = n.one("Add", [x, n.one("MatMul", [n.reshape(ctx, [1, tokens, dim]), n.rand(dim, dim)])])
    h = n.one("LayerNormalization", [x, ones, zeros], axis=-1)
    cls = n.one("Gather", [h, n.const(np.array(0, np.int64))], axis=1)
    logits = n.one("Gemm", [cls, n.rand(classes, dim), n.rand(classes)], transB=1)
    return n.model({"input": [1, 3, 16, 16]}, {"logits": logits})


def test_mini_vit_maps_to_one_segment():
    model = _mini_vit()
    assert analyze_coverage(model).mla_segments > 1
    assert rules_matching(model) == {"transformer-to-4d"}
    result = lift(model, "transformer-to-4d")
    after = result.coverage_after
    assert after.single_elf
    assert [b.op_type for b in after.blockers] == ["Reshape"]
    ops = {n.op_type for n in result.model.graph.node}
    assert not ops & {"Gather", "Gemm", "Squeeze", "Flatten"}


def test_channels_last_layernorm_moves_to_the_channel_axis():
    n = Net()
    x = n.one("Transpose", [n.conv("x", 3, 8)], perm=[0, 2, 3, 1])
    x = n.one("LayerNormalization", [x, n.rand(8), n.rand(8)], axis=-1)
    y = n.conv(n.one("Transpose", [x], perm=[0, 3, 1, 2]), 8, 4)
    model = n.model({"x": [1, 3, 4, 4]}, {"y": y})
    result = lift(model, "transformer-to-4d")
    assert result.coverage_after.single_elf and not result.coverage_after.blockers


def _ocr_head() -> onnx.ModelProto:
    """CRNN-style recognition head: [N,C,1,W] → Squeeze → [N,W,C] → Linear → Softmax(classes)."""
    n = Net(opset=13)
    x = n.conv("x", 3, 16, k=3, stride=2)
    x = n.one("MaxPool", [x], kernel_shape=[8, 1], strides=[8, 1])
    s = n.one("Squeeze", [x, n.const(np.array([2], np.int64))])
    t = n.one("Transpose", [s], perm=[0, 2, 1])
    y = n.one("Add", [n.one("MatMul", [t, n.rand(16, 37)]), n.rand(37)])
    return n.model({"x": [1, 3, 16, 64]}, {"probs": n.one("Softmax", [y], axis=2)})


def _swin_windows() -> onnx.ModelProto:
    """Swin window partition (rank 6) → per-window LayerNorm + Linear → window reverse."""
    n = Net()
    x = n.one("Transpose", [n.conv("x", 3, 8, k=3)], perm=[0, 2, 3, 1])
    w = n.one("Transpose", [n.reshape(x, [1, 2, 4, 2, 4, 8])], perm=[0, 1, 3, 2, 4, 5])
    w = n.reshape(w, [4, 16, 8])
    h = n.one("LayerNormalization", [w, n.rand(8), n.rand(8)], axis=-1)
    h = n.one("Add", [w, n.one("MatMul", [h, n.rand(8, 8)])])
    b = n.one("Transpose", [n.reshape(h, [1, 2, 2, 4, 4, 8])], perm=[0, 1, 3, 2, 4, 5])
    b = n.one("Transpose", [n.reshape(b, [1, 8, 8, 8])], perm=[0, 3, 1, 2])
    return n.model({"x": [1, 3, 8, 8]}, {"y": n.conv(b, 8, 4)})


def _mobilevit_unfold() -> onnx.ModelProto:
    """MobileViT: unfold 2×2 patches to [B·P, N, C], a transformer layer, fold back."""
    n = Net()
    x = n.conv("x", 3, 8, k=3)
    u = n.one("Transpose", [n.reshape(x, [32, 2, 4, 2])], perm=[0, 2, 1, 3])
    u = n.one("Transpose", [n.reshape(u, [1, 8, 16, 4])], perm=[0, 3, 2, 1])
    u = n.reshape(u, [4, 16, 8])
    h = n.one("LayerNormalization", [u, n.rand(8), n.rand(8)], axis=-1)
    h = n.one("Add", [u, n.one("MatMul", [h, n.rand(8, 8)])])
    f = n.one("Transpose", [n.reshape(h, [1, 4, 16, 8])], perm=[0, 3, 2, 1])
    f = n.one("Transpose", [n.reshape(f, [32, 4, 2, 2])], perm=[0, 2, 1, 3])
    return n.model({"x": [1, 3, 8, 8]}, {"y": n.conv(n.reshape(f, [1, 8, 8, 8]), 8, 4)})


@pytest.mark.parametrize("build", [_ocr_head, _swin_windows, _mobilevit_unfold])
def test_token_layouts_of_other_architectures(build):
    model = build()
    assert rules_matching(model) == {"transformer-to-4d"}
    result = lift(model, "transformer-to-4d")
    after = result.coverage_after
    assert after.single_elf
    assert all(b.op_type == "Reshape" for b in after.blockers)  # at most the output reshape
    ops = {n.op_type for n in result.model.graph.node}
    assert not ops & {"MatMul", "Squeeze"}


def test_a_region_that_cannot_be_lifted_leaves_the_graph_untouched(monkeypatch, yolo_head):
    from surgery.rules import rank4_lift, rank4_ops  # noqa: F401  (handlers registered)

    def refuse(lf, node):
        raise ValueError("not today")

    for op in list(rank4_lift.HANDLERS):
        monkeypatch.setitem(rank4_lift.HANDLERS, op, refuse)
    model = load_model(yolo_head)
    result = apply_rule(model, "reshape-to-4d")
    assert result.matches == []
    assert sorted(n.name for n in result.model.graph.node) == sorted(
        n.name for n in model.graph.node
    )


def _attention_with_a_five_axis_qkv() -> onnx.ModelProto:
    """Tokens → LayerNorm → qkv Linear → view with five non-unit axes → Transpose → Split of
    q, k, v (Hiera's mask-unit attention): no 4-D layout separates the Split's axis there."""
    n = Net()
    x = n.conv("x", 3, 8)
    t = n.one("Transpose", [n.reshape(x, [1, 8, 16])], perm=[0, 2, 1])
    t = n.one("LayerNormalization", [t, n.rand(8), n.rand(8)], axis=-1)
    qkv = n.reshape(n.one("MatMul", [t, n.rand(8, 24)]), [1, 2, 8, 3, 2, 4])
    qkv = n.one("Transpose", [qkv], perm=[3, 0, 4, 1, 2, 5])
    parts = n.op("Split", [qkv, n.const(np.array([1, 1, 1], np.int64))], n_out=3, axis=0)
    q, k, v = (n.one("Squeeze", [a, n.const(np.array([0], np.int64))]) for a in parts)
    mixed = n.reshape(n.one("Add", [n.one("Add", [q, k]), v]), [1, 16, 8])
    back = n.reshape(n.one("Transpose", [mixed], perm=[0, 2, 1]), [1, 8, 4, 4])
    return n.model({"x": [1, 3, 4, 4]}, {"y": n.conv(back, 8, 4)})


def test_a_node_the_lift_cannot_carry_is_left_out_and_the_rest_lifted():
    result = lift(_attention_with_a_five_axis_qkv(), "transformer-to-4d")
    placed = {p.op_type: p.processor for p in result.coverage_after.placements}
    assert placed["LayerNormalization"] == "MLA"
    assert "MatMul" not in placed  # the qkv Linear is a 1×1 Conv now
    assert placed["Split"] != "MLA"


def test_a_tensor_and_its_transpose_in_one_product_are_converted_apart():
    """t · tᵀ (a Gram matrix, attention of tokens with themselves): the Transpose relabels the
    same 4-D tensor, so the conversions of t and tᵀ to the MatMul layout must not be shared."""
    n = Net()
    t = n.one("Transpose", [n.reshape(n.conv("x", 3, 8), [1, 8, 16])], perm=[0, 2, 1])
    t = n.one("LayerNormalization", [t, n.rand(8), n.rand(8)], axis=-1)
    gram = n.one("Softmax", [n.one("MatMul", [t, n.one("Transpose", [t], perm=[0, 2, 1])])])
    mixed = n.one("Transpose", [n.one("MatMul", [gram, t])], perm=[0, 2, 1])
    model = n.model({"x": [1, 3, 4, 4]}, {"y": n.conv(n.reshape(mixed, [1, 8, 4, 4]), 8, 4)})
    result = lift(model, "transformer-to-4d")
    assert result.coverage_after.single_elf and not result.coverage_after.blockers


def _window_attention_einsum() -> onnx.ModelProto:
    """torchvision MaxViT's attention: q, k, v [1, windows, heads, tokens, d] (rank 5, four
    non-unit axes), Einsum scores "bwhid,bwhjd->bwhij", Softmax, Einsum "bwhij,bwhjd->bwhid"."""
    n = Net()
    q, k, v = (n.reshape(n.conv("x", 3, 8), [1, 2, 2, 8, 4]) for _ in range(3))
    scores = n.one("Einsum", [q, k], equation="bwhid,bwhjd->bwhij")
    attn = n.one("Softmax", [scores], axis=-1)
    mixed = n.one("Einsum", [attn, v], equation="bwhij,bwhjd->bwhid")
    return n.model({"x": [1, 3, 4, 4]}, {"y": n.conv(n.reshape(mixed, [1, 8, 4, 4]), 8, 4)})


@pytest.mark.parametrize("target", ["mlsoc", "rk3588"])
def test_rank5_einsum_attention_is_lifted_as_4d_matmuls(target):
    model = _window_attention_einsum()
    assert check_model(model, target, suggest=False).mla_segments > 1
    result = fix_model(model, target)
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    ops = {node.op_type for node in result.model.graph.node}
    assert "Einsum" not in ops and "MatMul" in ops


def _decomposed_relative_position() -> onnx.ModelProto:
    """SAM / ViTDet's decomposed relative position: rel_h [B·h, qh, qw, kh] unsqueezed last,
    rel_w [B·h, qh, qw, kw] unsqueezed before it, added: [B·h, qh, qw, kh, kw] has five
    non-unit axes, (qh, qw) broadcast alike, then viewed as the [B·h, q, k] attention bias."""
    n = Net()
    x = n.conv("x", 3, 8)
    rel_h = n.reshape(n.conv(x, 8, 8), [2, 4, 4, 4])
    rel_w = n.reshape(n.conv(x, 8, 8), [2, 4, 4, 4])
    rel_h = n.one("Unsqueeze", [rel_h, n.const(np.array([-1], np.int64))])
    rel_w = n.one("Unsqueeze", [rel_w, n.const(np.array([-2], np.int64))])
    bias = n.reshape(n.one("Add", [rel_h, rel_w]), [2, 16, 16])
    bias = n.one("Softmax", [bias], axis=-1)
    return n.model({"x": [1, 3, 4, 4]}, {"y": n.conv(n.reshape(bias, [1, 32, 4, 4]), 32, 4)})


def test_broadcast_blocks_merge_the_axes_both_operands_share():
    layout = L.broadcast_blocks((2, 4, 4, 4, 4), [(2, 4, 4, 4, 1), (2, 4, 4, 1, 4)])
    assert layout is not None and layout.groups == ((), (0, 1, 2), (3,), (4,))
    assert L.broadcast_blocks((2, 3, 4, 5, 6), [(2, 1, 4, 1, 6), (2, 3, 1, 5, 1)]) is None


def test_a_five_axis_outer_sum_is_carried_as_4d():
    result = fix_model(_decomposed_relative_position(), "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers


# ---------------------------------------------------------------------- real models (slow)


def _fix(name: str):
    model = load_model(shared_model(name), RUN_INPUTS.get(name))
    start = time.perf_counter()
    result = fix_model(model, "mlsoc")
    return result, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("name", ["yolov8n", "nudenet_320n"])
def test_fix_reaches_single_elf_on_yolov8_heads(name):
    result, seconds = _fix(name)
    data = result.to_dict()
    assert data["single_elf"], data["remaining_blockers"]
    assert "reshape-to-4d" in [s["rule"] for s in data["steps"]]
    assert all(s["verify"]["passed"] for s in data["steps"])
    assert _output_signature(result.model) == _output_signature(
        load_model(shared_model(name), RUN_INPUTS.get(name))
    )
    groups = [g["op_types"] for g in data["remaining_blockers"]]
    assert groups in ([], [["Reshape"]], [["Concat"], ["Reshape"]])  # + output-concat-to-host's pin
    if name == "yolov8n":
        assert seconds < 30


@pytest.mark.slow
def test_fix_lifts_the_rank5_anchor_head():
    result, _ = _fix("yolov5n_anchor")
    data = result.to_dict()
    assert data["single_elf"]
    assert data["blockers_after"] < data["blockers_before"]
    assert all(s["verify"]["passed"] for s in data["steps"])


@pytest.mark.slow
def test_classifier_to_conv_on_mobilenet_v2():
    model = load_model(shared_model("mobilenet_v2"))
    result = lift(model, "classifier-to-conv")
    assert [b.op_type for b in result.coverage_after.blockers] == ["Reshape"]


@pytest.mark.slow
def test_fix_maps_vit_tiny_to_one_segment():
    result, seconds = _fix("vit_tiny_patch16_224")
    data = result.to_dict()
    print(
        f"vit_tiny: segments {data['mla_segments_before']} → {data['mla_segments_after']}, "
        f"blockers {data['blockers_before']} → {data['blockers_after']}, {seconds:.1f} s, "
        f"steps {[s['rule'] for s in data['steps']]}"
    )
    assert data["mla_segments_before"] > 1
    assert data["single_elf"], data["remaining_blockers"]
    assert all(s["verify"]["passed"] for s in data["steps"])
