"""Mutate real and example models at the protobuf level and check every mutant: bad input must
get a typed error (a SurgeryError that names the problem) or a report, never another exception.

Each case copies one base model (the package's examples and small shared models), applies one
to three mutations (a dangling input, a dropped initializer, an attribute of another type, a
truncated or mistyped weight, a cycle, an impossible input size, …) and runs `check_model` on a
random target, with and without suggestions. A rule that fails on a mutant is counted too (it
warns and is left out of the suggestions: the model, not the rule, should be the one named).

    python bench/mutation_sweep.py [--cases 1500] [--seed 1] [--keep DIR]

`--keep DIR` writes the mutants that check accepts, with an INDEX.tsv, for the whole pipeline:
`python bench/pipeline_sweep.py --models DIR --target mlsoc rk3588` (every row must be ok or
refused; a crash is a bug). Prints a table and writes bench/results/mutation_sweep.json.

`--quantized` mutates QDQ models instead (the examples, fixed and quantized) — scales, zero
points, axes, swapped or bypassed Q/DQ inputs, besides some of the mutations above — and
compiles, runs and compares each (bench/results/mutation_sweep_quantized.json). Mutants that
compile and run must stay bit-exact against the integer reference.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from corpus import write_index
from onnx import TensorProto, numpy_helper

from surgery import examples
from surgery.check import check_model
from surgery.errors import SurgeryError

ROOT = Path(__file__).resolve().parents[1]
SHARED_MODELS = ROOT.parent / "shared" / "models"
SHARED_BASES = ("light_resnet50.onnx", "ppocr_mobile_v2_cls.onnx")
"""Small shared models with many nodes (Caffe2 ConstantOfShape weights, Paddle Constants)."""

Mutation = Callable[[onnx.ModelProto, random.Random], None]


def base_models() -> dict[str, onnx.ModelProto]:
    bases = {
        "cnn": examples.plain_cnn(),
        "yolo": examples.yolo_head(),
        "yolov5": examples.yolov5_head(),
        "transformer": examples.transformer_block(),
        "topk": examples.cnn_with_topk(),
    }
    for name in SHARED_BASES:
        if (SHARED_MODELS / name).is_file():
            bases[name.removesuffix(".onnx")] = onnx.load(SHARED_MODELS / name)
    return bases


def _node(model: onnx.ModelProto, rng: random.Random) -> onnx.NodeProto | None:
    return rng.choice(model.graph.node) if model.graph.node else None


def dangling_input(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _node(model, rng)
    if node is not None and node.input:
        node.input[rng.randrange(len(node.input))] = f"missing_{rng.randrange(10**6)}"


def dropped_initializer(model: onnx.ModelProto, rng: random.Random) -> None:
    if model.graph.initializer:
        del model.graph.initializer[rng.randrange(len(model.graph.initializer))]


def attribute_of_another_type(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _node(model, rng)
    if node is None or not node.attribute:
        return
    attr = rng.choice(node.attribute)
    kind = rng.randrange(4)
    if kind == 0:
        attr.ClearField("ints")
        attr.floats.extend([1.5, 2.5])
        attr.type = onnx.AttributeProto.FLOATS
    elif kind == 1:
        attr.s, attr.type = b"x", onnx.AttributeProto.STRING
    elif kind == 2:
        attr.ints.extend([-5, 10**12])  # another length, values out of any range
        attr.type = onnx.AttributeProto.INTS
    else:
        attr.i, attr.type = -(2**40), onnx.AttributeProto.INT


def dropped_attribute(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _node(model, rng)
    if node is not None and node.attribute:
        del node.attribute[rng.randrange(len(node.attribute))]


def other_op(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _node(model, rng)
    if node is not None:
        node.op_type = rng.choice(["Foo", "", "conv", "TopK", "NonZero", "If", "Reshape", "Gather"])


def other_domain(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _node(model, rng)
    if node is not None:
        node.domain = rng.choice(["com.example", "com.microsoft", "ai.onnx.ml", " "])


def input_count(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _node(model, rng)
    if node is None:
        return
    if node.input and rng.random() < 0.5:
        del node.input[-1]
    else:
        node.input.append(node.input[0] if node.input else "")


def weight_dims(model: onnx.ModelProto, rng: random.Random) -> None:
    if model.graph.initializer:
        weight = rng.choice(model.graph.initializer)
        if weight.dims:
            weight.dims[rng.randrange(len(weight.dims))] = rng.choice([0, -1, 7, 10**6])


def weight_type(model: onnx.ModelProto, rng: random.Random) -> None:
    if model.graph.initializer:
        rng.choice(model.graph.initializer).data_type = rng.choice([0, 8, 99, 16, 9])


def truncated_weight(model: onnx.ModelProto, rng: random.Random) -> None:
    raw = [t for t in model.graph.initializer if t.raw_data]
    if raw:
        weight = rng.choice(raw)
        weight.raw_data = weight.raw_data[: len(weight.raw_data) // 2]


def input_size(model: onnx.ModelProto, rng: random.Random) -> None:
    if model.graph.input:
        dims = rng.choice(model.graph.input).type.tensor_type.shape.dim
        if dims:
            dim = rng.choice(dims)
            dim.Clear()
            dim.dim_value = rng.choice([0, -3, 2**40, 1])


def _two_nodes(model: onnx.ModelProto, rng: random.Random):
    """Two distinct nodes that both have an input and an output, or None."""
    nodes = [n for n in model.graph.node if n.input and n.output]
    return rng.sample(nodes, 2) if len(nodes) >= 2 else None


def cycle(model: onnx.ModelProto, rng: random.Random) -> None:
    pair = _two_nodes(model, rng)
    if pair:
        pair[0].input[0] = pair[1].output[0]


def produced_twice(model: onnx.ModelProto, rng: random.Random) -> None:
    pair = _two_nodes(model, rng)
    if pair:
        pair[0].output[0] = pair[1].output[0]


def opset(model: onnx.ModelProto, rng: random.Random) -> None:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = rng.choice([0, 1, 5, 7, 30, 1000])


def constant_values(model: onnx.ModelProto, rng: random.Random) -> None:
    """A shape, axis or index constant of a data-movement op set to something out of range."""
    movers = ("Reshape", "Slice", "Gather", "Transpose", "Concat", "Split", "Unsqueeze", "Resize")
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type not in movers:
            continue
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.INT:
                attr.i = rng.choice([-100, 100, 5])
        for name in node.input[1:]:
            tensor = initializers.get(name)
            if tensor is not None and tensor.data_type == TensorProto.INT64:
                try:
                    values = numpy_helper.to_array(tensor).copy()
                except ValueError:  # an earlier mutation damaged it
                    continue
                if values.size:
                    values.flat[rng.randrange(values.size)] = rng.choice([-7, 0, -1, 10**9])
                    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
        return


def declared_shape(model: onnx.ModelProto, rng: random.Random) -> None:
    """A value_info that contradicts what inference finds."""
    node = _node(model, rng)
    if node is not None and node.output:
        info = model.graph.value_info.add(name=node.output[0])
        info.type.tensor_type.elem_type = rng.choice([1, 7, 9])
        for d in rng.choice([[1], [1, 2, 3], [0, 5], [1, 3, 640, 640, 2]]):
            info.type.tensor_type.shape.dim.add().dim_value = d


MUTATIONS: tuple[Mutation, ...] = (
    dangling_input,
    dropped_initializer,
    attribute_of_another_type,
    dropped_attribute,
    other_op,
    other_domain,
    input_count,
    weight_dims,
    weight_type,
    truncated_weight,
    input_size,
    cycle,
    produced_twice,
    opset,
    constant_values,
    declared_shape,
)


def _qdq_node(model: onnx.ModelProto, rng: random.Random, *ops: str) -> onnx.NodeProto | None:
    nodes = [n for n in model.graph.node if n.op_type in (ops or (_Q, _DQ))]
    return rng.choice(nodes) if nodes else None


_Q, _DQ = "QuantizeLinear", "DequantizeLinear"


def _parameter(model: onnx.ModelProto, node: onnx.NodeProto, k: int) -> onnx.TensorProto | None:
    name = node.input[k] if len(node.input) > k else ""
    return next((t for t in model.graph.initializer if t.name == name), None)


def bad_scale(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _qdq_node(model, rng)
    scale = _parameter(model, node, 1) if node is not None else None
    if scale is not None:
        values = numpy_helper.to_array(scale).astype(np.float32).copy()
        values.flat[rng.randrange(values.size)] = rng.choice([0.0, -1.0, np.nan, np.inf])
        scale.CopyFrom(numpy_helper.from_array(values, scale.name))


def bad_zero_point(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _qdq_node(model, rng)
    zero_point = _parameter(model, node, 2) if node is not None else None
    if zero_point is not None:
        zero_point.data_type = rng.choice([TensorProto.UINT8, TensorProto.INT16, TensorProto.FLOAT])


def bad_axis(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _qdq_node(model, rng)
    if node is not None:
        node.attribute.append(onnx.helper.make_attribute("axis", rng.choice([-9, 5, 0])))


def extra_scale(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _qdq_node(model, rng)
    scale = _parameter(model, node, 1) if node is not None else None
    if scale is not None:
        values = numpy_helper.to_array(scale).astype(np.float32).reshape(-1)
        scale.CopyFrom(numpy_helper.from_array(np.concatenate([values, values[:1]]), scale.name))


def swapped_qdq_inputs(model: onnx.ModelProto, rng: random.Random) -> None:
    node = _qdq_node(model, rng)
    if node is not None and len(node.input) > 1:
        node.input[0], node.input[1] = node.input[1], node.input[0]


def bypassed_dequantize(model: onnx.ModelProto, rng: random.Random) -> None:
    """A reader of a DequantizeLinear reads its integer codes instead."""
    node = _qdq_node(model, rng, _DQ)
    if node is not None:
        for reader in model.graph.node:
            for k, name in enumerate(reader.input):
                if name == node.output[0]:
                    reader.input[k] = node.input[0]


QDQ_MUTATIONS: tuple[Mutation, ...] = (
    bad_scale,
    bad_zero_point,
    bad_axis,
    extra_scale,
    swapped_qdq_inputs,
    bypassed_dequantize,
    attribute_of_another_type,
    constant_values,
    weight_dims,
    other_op,
    input_count,
    declared_shape,
)


def quantized_bases() -> dict[str, onnx.ModelProto]:
    """The examples, fixed to one segment and quantized (two seeded calibration samples)."""
    from compiler.quantize import quantize_model
    from surgery.rules.fix import fix_model
    from surgery.verify import make_inputs

    bases = {}
    for name, model in base_models().items():
        if name in SHARED_BASES_STEMS:
            continue
        fixed = fix_model(model, "mlsoc").model
        samples = [make_inputs(fixed, seed=seed) for seed in range(2)]
        bases[name] = quantize_model(fixed, samples).model
    return bases


SHARED_BASES_STEMS = frozenset(name.removesuffix(".onnx") for name in SHARED_BASES)


def check_stage(model: onnx.ModelProto, rng: random.Random) -> str:
    check_model(model, rng.choice(["mlsoc", "modalix", "rk3588"]), suggest=rng.random() < 0.7)
    return "report"


def compile_stage(model: onnx.ModelProto, rng: random.Random) -> str:
    """Compile, run and compare with the integer reference."""
    from compiler.archive import read_archive
    from compiler.compile import compile_model
    from compiler.runtime.compare import compare_with_reference
    from compiler.runtime.pipeline import run_archive
    from surgery.verify import make_inputs

    with tempfile.TemporaryDirectory() as folder:
        result = compile_model(model, folder, target=rng.choice(["mlsoc", "rk3588"]))
        archive = read_archive(result.archive)
    feed = make_inputs(model, seed=3)
    outputs, stats = run_archive(archive, feed, keep_tensors=True)
    comparison = compare_with_reference(archive.manifest, model, feed, outputs, stats.tensors)
    return "compiled, ran, bit-exact" if comparison.mla_bit_exact else "NOT bit-exact"


class RuleFailures(logging.Handler):
    """Counts the rules that failed on a mutant (surgery.rules.suggest logs each at debug)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            where = traceback.extract_tb(error.__traceback__)[-1]
            self.seen[
                f"{record.getMessage()}: {type(error).__name__} at {Path(where.filename).name}:{where.lineno}"
            ] += 1


def run(cases: int, seed: int, keep: Path | None, quantized: bool = False) -> dict:
    rng = random.Random(seed)
    bases = quantized_bases() if quantized else base_models()
    mutations = QDQ_MUTATIONS if quantized else MUTATIONS
    stage = compile_stage if quantized else check_stage
    outcomes: Counter[str] = Counter()
    untyped: Counter[str] = Counter()
    failures = RuleFailures()
    suggest_log = logging.getLogger("surgery.rules.suggest")
    suggest_log.addHandler(failures)
    suggest_log.setLevel(logging.DEBUG)
    suggest_log.propagate = False  # their one-line warnings would flood the table
    logging.getLogger("surgery.model").setLevel(logging.ERROR)  # "recorded shapes contradict"
    kept: dict[str, str] = {}
    for case in range(cases):
        name = rng.choice(sorted(bases))
        model = onnx.ModelProto()
        model.CopyFrom(bases[name])
        applied = rng.sample(mutations, rng.choice([1, 1, 2, 3]))
        for mutate in applied:
            mutate(model, rng)
        given = model.SerializeToString()
        try:
            outcomes[stage(model, rng)] += 1
            if keep is not None:
                file = f"{case:05d}_{name}_{'+'.join(m.__name__ for m in applied)}.onnx"
                onnx.save(model, keep / file)
                kept[file] = ""
        except SurgeryError:
            outcomes["typed error"] += 1
        except Exception as error:  # noqa: BLE001 - what this sweep looks for
            where = traceback.extract_tb(error.__traceback__)[-1]
            untyped[f"{type(error).__name__} at {Path(where.filename).name}:{where.lineno}"] += 1
            outcomes["untyped error"] += 1
        if model.SerializeToString() != given:
            outcomes["mutant changed (must not be)"] += 1
    if keep is not None:
        write_index(keep, kept)
    return {
        "cases": cases,
        "seed": seed,
        "quantized": quantized,
        "outcomes": dict(outcomes),
        "untyped_errors": dict(untyped),
        "rule_failures": dict(failures.seen),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="write the mutants check accepts here")
    parser.add_argument(
        "--quantized", action="store_true", help="mutate QDQ models; compile, run, compare"
    )
    parser.add_argument("--out", type=Path, help="default: bench/results/mutation_sweep*.json")
    args = parser.parse_args()
    results = ROOT / "bench" / "results"
    args.out = args.out or results / (
        "mutation_sweep_quantized.json" if args.quantized else "mutation_sweep.json"
    )
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    np.seterr(all="ignore")  # constant folding of mutants overflows on purpose
    result = run(args.cases, args.seed, args.keep, args.quantized)
    print(f"{result['cases']} mutants (seed {result['seed']})")
    for outcome, count in sorted(result["outcomes"].items()):
        print(f"  {outcome:26s} {count:6d}")
    for title, table in (("untyped errors", "untyped_errors"), ("rule failures", "rule_failures")):
        print(f"{title}: {sum(result[table].values())}")
        for what, count in sorted(result[table].items(), key=lambda kv: -kv[1]):
            print(f"  {count:4d}  {what}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
