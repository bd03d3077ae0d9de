"""`quantize_model`: float ONNX + calibration data + settings → QDQ ONNX for one target.

The steps, each in its own module:

1. prepare   — name nodes, raise the opset, weights to initializers, fold BN (float-equivalent)
2. coverage  — `surgery.coverage` decides which nodes run on the MLA; only those are quantized
3. equalize  — optional cross-layer equalization (float-equivalent)
4. plan      — which tensors get Q/DQ, with which scheme; weight axes; fusion; shared scales
5. calibrate — one streaming pass; observers per tensor
6. ranges    — calibration method → range → scale and zero point
7. qdq       — write the QDQ model
8. bias correction (optional) — a second pass comparing float and QDQ; rebuild

Opset: int8 Q/DQ with per-channel axes needs opset 13; int16 activations and int4 weights need
opset 21, where ONNX and ONNX Runtime (≥ 1.20) both accept them in the default domain. The model
is converted upward with ONNX's version converter when needed (never downward).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from compiler.defines import QuantizationParams
from compiler.quantize.bias_correction import correct_biases
from compiler.quantize.calibrate import DEFAULT_MAX_OUTPUT_BYTES, Progress, calibrate
from compiler.quantize.equalize import EqualizationReport, equalize
from compiler.quantize.errors import QuantizationError
from compiler.quantize.observers import Observer, SoftmaxInputObserver
from compiler.quantize.plan import QuantPlan, check_target_precisions, make_plan
from compiler.quantize.prepare import PreparedModel, prepare_model
from compiler.quantize.qdq import BuildResult, build_qdq
from compiler.quantize.qparams import ActivationQParams, activation_qparams
from compiler.quantize.ranges import Range, make_observer, select_range
from compiler.quantize.samples import CalibrationData, SamplePasses, non_tensor_input_error
from compiler.quantize.softmax import mask_operand_floors, observer_for, softmax_inputs
from surgery.coverage import PLACEMENT_METADATA_KEY, analyze_coverage
from surgery.errors import first_line
from surgery.graph import GraphView
from surgery.model import PROTOBUF_LIMIT, model_nbytes
from surgery.qdq import QUANTIZATION_METADATA_KEY
from surgery.qoperator import QOPERATOR_OPS
from surgery.targets import Target, resolve_target

__all__ = [
    "METADATA_KEY",
    "QuantizedModel",
    "check_quantizable",
    "quantize_model",
    "required_opset",
]

METADATA_KEY = QUANTIZATION_METADATA_KEY
"""`metadata_props` key of the JSON quantization record (defined in surgery.qdq)."""

FLOAT_SOURCES = (onnx.ModelProto, str, os.PathLike)
"""What `quantize_model` takes as the float model (onnx.checker reads each)."""

_QDQ_OPS = (
    frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}) | QOPERATOR_OPS
)


@dataclass
class QuantizedModel:
    """The QDQ model and what was decided to produce it."""

    model: onnx.ModelProto
    float_model: onnx.ModelProto
    """The prepared float model (same node names; weights equalized/bias-corrected if asked)."""
    params: QuantizationParams
    target: str
    report: dict[str, Any] = field(default_factory=dict)
    """The record also stored in `model.metadata_props[surgery.quantization]`."""


def required_opset(params: QuantizationParams) -> int:
    wide = any(s.kind == "int" and s.bits in (4, 16) for s in params.all_schemes())
    return 21 if wide else 13


def quantize_model(
    model: onnx.ModelProto,
    calibration_data: CalibrationData,
    params: QuantizationParams | Any = None,
    *,
    target: str | Target = "mlsoc",
    progress: Progress | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    op_target: Mapping[str, str] | None = None,
    elementwise_groups: bool = False,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> QuantizedModel:
    """Post-training quantization to standard QDQ ONNX (see the module docstring for the steps).

    `params` is a `QuantizationParams` (default: `default_quantization`) or anything with
    `to_quantization_params()` (an `RknnConfig`). `progress(done, total)` is called after each
    calibration sample (total is None when the data has no length). `op_target` pins nodes (by
    name or op type) to MLA/CVU/APU as RKNN's option does; only MLA nodes are quantized.
    x·Sigmoid(x) and x·HardSigmoid(x) are always one table (no Q/DQ on the gate).
    `elementwise_groups=True` does the same for every run of single-input elementwise ops (see
    `compiler.quantize.groups`; +0.9 dB on PP-OCRv4). It is off by default until the integer
    executor builds tables for such runs: until then the compiler would run them on the CVU and
    split the MLA segment.
    """
    params = _resolve_params(params)
    tgt = resolve_target(target)
    check_target_precisions(params, tgt)
    _reject_quantized(model)
    check_quantizable(model)
    data = SamplePasses(calibration_data)
    if params.bias_correction and not data.reiterable:
        raise QuantizationError(
            "bias correction needs a second pass over the calibration data, and a one-shot iterator "
            "(generator) gives only one",
            hint="pass a list, a dataset from load_calibration_data, or a callable returning a fresh iterator",
        )
    prepared = prepare_model(
        model,
        opset=required_opset(params),
        input_shapes=input_shapes,
        add_biases=params.bias_correction,
    )
    _check_names(params, prepared)
    coverage = analyze_coverage(prepared.model, tgt, op_target=op_target, suggest=False)
    equalization = EqualizationReport()
    if params.channel_equalization:
        eligible = {
            p.name
            for p in coverage.placements
            if p.processor == "MLA" and p.name not in params.unquantized_nodes
        }
        equalization = equalize(prepared.model, eligible)
    plan = make_plan(prepared.model, coverage, params, elementwise_groups=elementwise_groups)
    observers, by_tensor = _observers(prepared.model, plan)
    stats = calibrate(
        prepared.model, by_tensor, data, progress=progress, max_output_bytes=max_output_bytes
    )
    qparams = _activation_qparams(prepared.model, plan, observers)
    built = build_qdq(prepared.model, plan, qparams)
    corrections: dict[str, dict[str, float]] = {}
    if params.bias_correction:
        corrections = correct_biases(prepared.model, built, plan, qparams, data, progress=progress)
        built = build_qdq(prepared.model, plan, qparams)
    report = _report(
        params,
        tgt,
        prepared,
        plan,
        observers,
        qparams,
        built,
        equalization,
        corrections,
        stats.samples,
    )
    _write_metadata(built.model, report, plan, tgt, prepared)
    _check(built.model, model)
    return QuantizedModel(built.model, prepared.model, params, tgt.name, report)


# --------------------------------------------------------------------------- steps


def _resolve_params(params: Any) -> QuantizationParams:
    if params is None:
        return QuantizationParams()
    if isinstance(params, QuantizationParams):
        return params
    convert = getattr(params, "to_quantization_params", None)
    if callable(convert):
        return convert()
    raise QuantizationError(
        f"quantization settings must be QuantizationParams or RknnConfig, got {type(params).__name__}"
    )


def _reject_quantized(model: Any) -> None:
    if isinstance(model, onnx.ModelProto):
        found = sorted({n.op_type for n in model.graph.node if n.op_type in _QDQ_OPS})
        if found:
            raise QuantizationError(
                f"the model is already quantized (it contains {', '.join(found)})",
                hint=(
                    "quantize the float model it was made from, or compile this one as it is "
                    "with `surgery compile` (QDQ and ONNX Runtime QOperator models keep their "
                    "scales); `surgery fix` rewrites it as its float model"
                ),
            )


def check_quantizable(model: Any, label: str | None = None) -> None:
    """What calibration cannot work around, said before it starts: graph inputs that are not
    tensors (sequences, maps, optionals; calibration samples are tensors). A graph without
    outputs is refused when the model is loaded (`surgery.model.validate_graph`)."""
    if not isinstance(model, onnx.ModelProto):
        return  # a path: the calibration pass's input signature checks the prepared model
    error = non_tensor_input_error(model)
    if error is not None:
        where = f"{label}: " if label else ""
        raise QuantizationError(f"{where}{error.message}", hint=error.hint)


def _check_names(params: QuantizationParams, prepared: PreparedModel) -> None:
    for field_name, names in (
        ("unquantized_nodes", params.unquantized_nodes),
        ("custom_quantization_configs", tuple(params.custom_quantization_configs)),
    ):
        unknown = [n for n in names if n not in prepared.names]
        if unknown:
            sample = ", ".join(sorted(prepared.names)[:8])
            raise QuantizationError(
                f"{field_name} names node(s) not in the model: {', '.join(map(repr, unknown))}",
                hint=f"node names look like: {sample} …",
            )


def _observers(
    model: onnx.ModelProto, plan: QuantPlan
) -> tuple[dict[str, Observer], dict[str, list[Observer]]]:
    """Each observed activation's observer, and the tensors that feed them. An activation read
    only by a Softmax is observed at the Softmax's input, blind to what the Softmax cannot
    resolve (`compiler.quantize.softmax`): attention masks would otherwise set its range."""
    softmax = softmax_inputs(GraphView(model), plan)
    observers: dict[str, Observer] = {}
    by_tensor: dict[str, list[Observer]] = {}
    for key, spec in plan.observed().items():
        obs = make_observer(spec.method)
        tensor = spec.tensor
        found = softmax.get(key)
        if found is not None:
            obs, tensor = observer_for(obs, found), found.tensor
        observers[key] = obs
        by_tensor.setdefault(tensor, []).append(obs)
    return observers, by_tensor


def _activation_qparams(
    model: onnx.ModelProto, plan: QuantPlan, observers: Mapping[str, Observer]
) -> dict[str, ActivationQParams]:
    """Each observed activation's scale and zero point from its calibrated range; mask operands
    of Softmax-clamped sums stop where the sum no longer sees them (`mask_operand_floors`)."""
    ranges = {
        key: select_range(plan.activations[key].method, obs, plan.activations[key].scheme)
        for key, obs in observers.items()
    }
    clamped = [
        key
        for key, obs in observers.items()
        if isinstance(obs, SoftmaxInputObserver) and obs.clamped
    ]
    if clamped:
        for key, floor in mask_operand_floors(GraphView(model), plan, ranges, clamped).items():
            ranges[key] = Range(floor, ranges[key].hi)
    return {
        key: activation_qparams(rng, plan.activations[key].scheme) for key, rng in ranges.items()
    }


def _report(
    params: QuantizationParams,
    target: Target,
    prepared: PreparedModel,
    plan: QuantPlan,
    observers: Mapping[str, Observer],
    qparams: Mapping[str, ActivationQParams],
    built: BuildResult,
    equalization: EqualizationReport,
    corrections: Mapping[str, Mapping[str, float]],
    samples: int,
) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for key, spec in plan.activations.items():
        entry: dict[str, Any] = {"tensor": spec.tensor, "scheme": spec.scheme.describe()}
        if spec.share_with is not None:
            entry["shared_with"] = spec.share_with
        elif key in qparams:
            obs = observers[key]
            entry.update(qparams[key].to_dict())
            entry["method"] = spec.method.name
            entry["observed_min"] = obs.min if not obs.empty else None
            entry["observed_max"] = obs.max if not obs.empty else None
            if isinstance(obs, SoftmaxInputObserver) and obs.clamped:
                entry["softmax_floor"] = obs.floor
                entry["softmax_span"] = obs.span
        tensors[key] = entry
    hybrid = list(plan.decisions)
    hybrid += [{"node": n, "decision": "float", "reason": r} for n, r in plan.unquantized.items()]
    hybrid += [
        {"node": n, "decision": "custom", "reason": json.dumps(c.to_dict())}
        for n, c in params.custom_quantization_configs.items()
    ]
    return {
        "version": 1,
        "target": target.name,
        "requantization_mode": params.requantization_mode.value,
        "calibration": {"method": params.calibration_method.to_dict(), "samples": samples},
        "activation_scheme": params.activation_quantization_scheme.describe(),
        "weight_scheme": params.weight_quantization_scheme.describe(),
        "activation_storage": "signed: asymmetric schemes store int8/int16 with a zero point",
        "params": params.to_dict(),
        "preparation": prepared.to_dict(),
        "quantized_nodes": len(plan.quantized),
        "unquantized_nodes": dict(plan.unquantized),
        "fused": dict(plan.fused),
        "elementwise_groups": [g.to_dict() for g in plan.groups],
        "hybrid": hybrid,
        "equalization": equalization.to_dict(),
        "bias_correction": dict(corrections),
        "tensors": tensors,
        "weights": built.weights,
        "notes": built.notes,
    }


def _write_metadata(
    model: onnx.ModelProto,
    report: Mapping[str, Any],
    plan: QuantPlan,
    target: Target,
    prepared: PreparedModel,
) -> None:
    """The JSON record, and placement pins so coverage of the QDQ model keeps float nodes off the MLA."""
    props = {p.key: p.value for p in model.metadata_props}
    props[METADATA_KEY] = json.dumps(report, sort_keys=True, default=_json_default)
    if plan.unquantized:
        pins = json.loads(props.get(PLACEMENT_METADATA_KEY, "{}"))
        by_name = {n.name: n.op_type for n in prepared.model.graph.node}
        for name in plan.unquantized:
            op = by_name.get(name, "")
            pins[name] = "CVU" if target.supports(op, "CVU") else "APU"
        props[PLACEMENT_METADATA_KEY] = json.dumps(pins, sort_keys=True)
    del model.metadata_props[:]
    for key in sorted(props):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, props[key]


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def _checker_problem(model: onnx.ModelProto | str | os.PathLike) -> str | None:
    """onnx.checker's complaint about `model` (a ModelProto or a path), or None when it passes
    or cannot be checked (a ModelProto too large to serialise: the checker needs its path)."""
    if isinstance(model, onnx.ModelProto) and model_nbytes(model) >= PROTOBUF_LIMIT - 64 * 2**20:
        return None
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else os.fspath(model))
    except onnx.checker.ValidationError as exc:
        return first_line(exc)
    return None


def _check(model: onnx.ModelProto, float_model: Any) -> None:
    """The QDQ model must pass onnx.checker. When it fails, the float model it came from is
    checked too: a model that is invalid already (an op with no schema, an input named "")
    is the user's to fix, not a quantizer bug."""
    problem = _checker_problem(model)
    if problem is None:
        return
    before = _checker_problem(float_model) if isinstance(float_model, FLOAT_SOURCES) else None
    if before is not None:
        also = "" if before == problem else f" (the quantized model: {problem})"
        raise QuantizationError(
            f"the input model is not valid ONNX: onnx.checker: {before}{also}",
            hint="fix the float model (ONNX Runtime and the compiler cannot run it either) "
            "and quantize again",
        )
    raise QuantizationError(f"the QDQ model fails onnx.checker (a quantizer bug): {problem}")
