"""The public API in the shape users of the vendor toolchains know.

    from compiler.api import load_model
    from compiler.defines import default_quantization, HistogramPercentileMethod

    net = load_model("model.onnx", input_shapes={"images": [1, 3, 640, 640]}, target="mlsoc")
    model = net.quantize("calib_images/", default_quantization.with_calibration(
        HistogramPercentileMethod(99.9, 2048)), model_name="yolo")
    model.save("yolo", "out/")            # out/yolo.onnx (QDQ) + out/yolo.quant.json
    same = Model.load("yolo", "out/")

`LoadedNet.execute` runs the float model and `Model.execute` the QDQ model, both with ONNX
Runtime; the QDQ model is the float-simulated reference that the integer executor and the
compiled program are checked against. An `RknnConfig` is accepted wherever a quantization
config is: one quantizer, two front doors.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort

from compiler.compile import CompileResult
from compiler.defines import QuantizationParams, default_quantization
from compiler.quantize.calibrate import Progress, reference_session
from compiler.quantize.data import load_calibration_data
from compiler.quantize.errors import QuantizationError
from compiler.quantize.quantizer import quantize_model
from compiler.quantize.rknn_config import RknnConfig
from compiler.quantize.samples import CalibrationData, as_feed, input_signature
from surgery.errors import ModelNotFoundError
from surgery.model import load_model as _load_float
from surgery.model import read_model, save_model
from surgery.qdq import quantization_record
from surgery.targets import Target, resolve_target

__all__ = ["LoadedNet", "Model", "load_model"]

Layout = Literal["NCHW", "NHWC"]
SIDECAR_SUFFIX = ".quant.json"
SIDECAR_FORMAT = "model-surgery/quantized-model"


def _execute(
    session: ort.InferenceSession, model: onnx.ModelProto, inputs: Any
) -> dict[str, np.ndarray]:
    feed = as_feed(inputs, input_signature(model), 0)
    values = session.run(None, feed)
    return {meta.name: np.asarray(v) for meta, v in zip(session.get_outputs(), values, strict=True)}


@dataclass
class LoadedNet:
    """A validated, shape-inferred float model bound to a target."""

    model: onnx.ModelProto
    target: str = "mlsoc"
    layout: Layout = "NCHW"
    input_shapes: dict[str, list[int]] | None = None
    name: str = "model"
    _session: ort.InferenceSession | None = field(default=None, repr=False, compare=False)
    _profile: Target | None = field(default=None, repr=False, compare=False)
    """The profile `load_model` read: a profile file's target cannot be found again by name."""

    def resolved_target(self) -> Target:
        """The target profile (`target` is its name): the one `load_model` read, else by name."""
        return _target_of(self.target, self._profile)

    def execute(self, inputs: Any) -> dict[str, np.ndarray]:
        """Run the float model (ONNX Runtime); inputs as a dict, an array or a list of arrays."""
        if self._session is None:
            self._session = reference_session(self.model, label="the float model")
        return _execute(self._session, self.model, inputs)

    def quantize(
        self,
        calibration_data: CalibrationData | str | os.PathLike,
        quantization_config: QuantizationParams | RknnConfig = default_quantization,
        model_name: str | None = None,
        progress: Progress | None = None,
        *,
        auto_hybrid: bool = False,
        target_sqnr_db: float | None = None,
    ) -> Model:
        """Calibrate on `calibration_data` (samples, or a folder / dataset.txt path) and quantize.

        `auto_hybrid=True` (RKNN's `build(auto_hybrid=True)`) raises layers under the cosine
        threshold — an `RknnConfig`'s `auto_hybrid_cos_thresh` / `auto_hybrid_euc_thresh`, else
        0.98 — to int16 (bf16 on modalix); `target_sqnr_db` raises the most output-sensitive
        layers until the outputs reach it (`compiler.quantize.hybrid`). The hybrid record is in
        `Model.report["auto_hybrid"]`.
        """
        target: str | Target = self.resolved_target()
        op_target: dict[str, str] | None = None
        if isinstance(quantization_config, RknnConfig):
            target = quantization_config.target
            op_target = quantization_config.placement_pins() or None
        if isinstance(calibration_data, str | os.PathLike):
            calibration_data = self._dataset(Path(calibration_data), quantization_config)
        if auto_hybrid or target_sqnr_db is not None:
            return self._quantize_hybrid(
                calibration_data,
                quantization_config,
                model_name,
                progress,
                target,
                op_target,
                target_sqnr_db,
            )
        result = quantize_model(
            self.model,
            calibration_data,
            quantization_config,
            target=target,
            progress=progress,
            op_target=op_target,
        )
        params = result.params
        return Model(
            result.model,
            result.target,
            model_name or self.name,
            params,
            result.report,
            _profile=target if isinstance(target, Target) else None,
        )

    def _quantize_hybrid(
        self,
        calibration_data: CalibrationData,
        config: QuantizationParams | RknnConfig,
        model_name: str | None,
        progress: Progress | None,
        target: str | Target,
        op_target: dict[str, str] | None,
        target_sqnr_db: float | None,
    ) -> Model:
        """`auto_hybrid` with the config's thresholds, target and pins; the record joins the report."""
        from compiler.quantize.hybrid import auto_hybrid

        result = auto_hybrid(
            self.model,
            calibration_data,
            config,
            target=target,
            op_target=op_target,
            progress=progress,
            target_sqnr_db=target_sqnr_db,
        )
        q = result.quantized
        report = {**q.report, "auto_hybrid": result.to_dict()}
        profile = target if isinstance(target, Target) else None
        return Model(q.model, q.target, model_name or self.name, q.params, report, _profile=profile)

    def _dataset(self, path: Path, config: QuantizationParams | RknnConfig) -> Any:
        mean = std = None
        bgr = False
        if isinstance(config, RknnConfig):
            mean, std = config.input_mean_std(0)
            bgr = config.input_bgr(0)
        return load_calibration_data(
            path,
            self.model,
            input_shapes=self.input_shapes,
            mean=mean,
            std=std,
            bgr=bgr,
            layout=self.layout,
        )


def load_model(
    path_or_proto: str | os.PathLike | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    layout: Layout = "NCHW",
    target: str | Target = "mlsoc",
) -> LoadedNet:
    """Load and validate an ONNX model for `target` (a built-in target's name, a profile .yaml
    or a `Target`); `input_shapes` fixes dynamic dimensions."""
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"layout={layout!r}: expected NCHW or NHWC")
    profile = resolve_target(target)
    model = _load_float(path_or_proto, input_shapes)
    if isinstance(path_or_proto, onnx.ModelProto):
        name = path_or_proto.graph.name or "model"
    else:
        name = Path(path_or_proto).stem
    shapes = {k: list(v) for k, v in input_shapes.items()} if input_shapes else None
    return LoadedNet(model, profile.name, layout, shapes, name, _profile=profile)


def _target_of(name: str, profile: Target | None) -> Target:
    """The profile `profile` while it is the one named `name` (a caller may set `target` to
    another name), else the target `name` resolves to."""
    if profile is not None and profile.name == name:
        return profile
    return resolve_target(name)


@dataclass
class Model:
    """A quantized model: standard QDQ ONNX plus the settings and record that produced it."""

    qdq_model: onnx.ModelProto
    target: str
    name: str
    params: QuantizationParams
    report: dict[str, Any] = field(default_factory=dict)
    _session: ort.InferenceSession | None = field(default=None, repr=False, compare=False)
    _profile: Target | None = field(default=None, repr=False, compare=False)
    """The profile quantized for, when it came from a file (not found again by its name)."""
    _saved_path: Path | None = field(default=None, repr=False, compare=False)
    """Where `save` (or `load`) last put the .onnx: compile records it in the archive, so
    `surgery run --compare-reference` finds the model without --model."""

    def execute(self, inputs: Any) -> dict[str, np.ndarray]:
        """Run the QDQ model in ONNX Runtime as the float-simulated reference (Q/DQ not fused
        into ORT's int8 kernels, which round differently)."""
        if self._session is None:
            self._session = reference_session(self.qdq_model, label="the quantized model")
        return _execute(self._session, self.qdq_model, inputs)

    def analyze_quantization_error(
        self,
        data: CalibrationData | str | os.PathLike,
        float_model: LoadedNet | onnx.ModelProto | str | os.PathLike,
        limit: int | None = None,
        progress: Progress | None = None,
    ) -> Any:
        """Per-layer entire / single error against `float_model` (the model this was quantized
        from), RKNN `accuracy_analysis` style; returns `compiler.quantize.analysis.AnalysisResult`.
        `data` is samples or a folder / dataset.txt read as for calibration (no mean/std)."""
        from compiler.quantize.analysis import analyze_quantization_error

        net = float_model if isinstance(float_model, LoadedNet) else load_model(float_model)
        if isinstance(data, str | os.PathLike):
            data = net._dataset(Path(data), self.params)
        return analyze_quantization_error(
            net.model, self.qdq_model, data, limit=limit, progress=progress
        )

    def compile(self, output_path: str | os.PathLike = ".", **options: Any) -> CompileResult:
        """Compile into `<output_path>/<name>_mpk.tar.gz` (one .elf per MLA segment).

        Options as in the vendor API: `batch_size`, `compress`, `tessellate_parameters`,
        `memory_plan_strategy`, `compute_order`, `single_core_mode`, `custom_string`.
        """
        from compiler.compile import compile_model

        return compile_model(
            self.qdq_model,
            output_path,
            target=options.pop("target") if "target" in options else self._compile_target(),
            model_name=options.pop("model_name", self.name),
            source_path=options.pop("source_path", self._saved_path),
            **options,
        )

    def _compile_target(self) -> Target:
        """The profile quantized for while `target` still names it, else the one it names."""
        return _target_of(self.target, self._profile)

    @property
    def segments(self) -> dict[str, Any]:
        """MLA segments by name ("MLA_0" …) with `input_names` / `output_names`, for addressing
        tensors in `tessellate_parameters`."""
        from surgery.check import check_model

        report = check_model(self.qdq_model, self._compile_target(), suggest=False)
        return {
            seg.name: SimpleNamespace(
                name=seg.name, input_names=seg.inputs, output_names=seg.outputs, nodes=seg.nodes
            )
            for seg in report.segments
        }

    @property
    def _net(self) -> Any:
        """Vendor-compatible access: `model._net.nodes["MLA_0"].input_names`."""
        return SimpleNamespace(nodes=self.segments)

    def save(self, name: str | None = None, directory: str | os.PathLike = ".") -> Path:
        """Write `<directory>/<name>.onnx` and the `<name>.quant.json` sidecar; returns the .onnx path."""
        name = name or self.name
        folder = Path(directory)
        onnx_path = save_model(self.qdq_model, folder / f"{name}.onnx")
        payload = onnx_path.read_bytes() if onnx_path.stat().st_size < 2**31 else b""
        sidecar = {
            "format": SIDECAR_FORMAT,
            "version": 1,
            "name": name,
            "target": self.target,
            "model": onnx_path.name,
            "sha256": hashlib.sha256(payload).hexdigest() if payload else None,
            "params": self.params.to_dict(),
        }
        _write_text(
            folder / f"{name}{SIDECAR_SUFFIX}", json.dumps(sidecar, indent=2, sort_keys=True) + "\n"
        )
        self._saved_path = onnx_path
        return onnx_path

    @classmethod
    def load(cls, name: str, directory: str | os.PathLike = ".") -> Model:
        """Read a model written by `save` (the sidecar's checksum must match the .onnx)."""
        folder = Path(directory)
        sidecar_path = folder / f"{name}{SIDECAR_SUFFIX}"
        if not sidecar_path.is_file():
            raise ModelNotFoundError(f"{sidecar_path}: no such file (written by Model.save)")
        try:
            sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise QuantizationError(f"{sidecar_path}: not a readable sidecar ({exc})") from None
        if sidecar.get("format") != SIDECAR_FORMAT:
            raise QuantizationError(f"{sidecar_path}: not a {SIDECAR_FORMAT} sidecar")
        onnx_path = folder / sidecar["model"]
        expected = sidecar.get("sha256")
        if (
            expected
            and onnx_path.is_file()
            and hashlib.sha256(onnx_path.read_bytes()).hexdigest() != expected
        ):
            raise QuantizationError(
                f"{onnx_path}: does not match the checksum recorded in {sidecar_path.name}"
            )
        proto = read_model(onnx_path)
        report = quantization_record(proto)
        params = QuantizationParams.from_dict(sidecar["params"])
        loaded = cls(proto, sidecar["target"], sidecar["name"], params, report)
        loaded._saved_path = onnx_path
        return loaded


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
