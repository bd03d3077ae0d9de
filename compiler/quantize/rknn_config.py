"""The RKNN-Toolkit2-style front door: `RknnConfig(...)` validated like `rknn.config(...)`.

It converts into the same `QuantizationParams` the SiMa-style API builds, so there is one
quantizer behind two front doors. Invalid configurations raise a ValueError (pydantic's
ValidationError is one) naming the field and the allowed values.

Deviations from RKNN, on purpose:
- RKNN calls w8a8 weights "asymmetric"; our MLA datapath uses symmetric weights (zero point 0,
  per channel by default), which is also what RKNN's per-channel weights end up as. Activations
  are asymmetric int8.
- 4-bit weights exist only group-wise (w4a16 with quantized_method group32 … group256).
- `gdq` (gradient-based) is not implemented.
- Only the rk3588 profile exists today; other RKNN platforms use it for placement.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from compiler.defines import (
    CalibrationMethod,
    HistogramEntropyMethod,
    HistogramMSEMethod,
    MinMaxMethod,
    QuantizationParams,
    QuantizationScheme,
    RequantizationMode,
    float16_scheme,
    quantization_scheme,
)

__all__ = ["DTYPE_PLATFORMS", "PLATFORMS", "RknnConfig"]

PLATFORMS = (
    "rv1103",
    "rv1103b",
    "rv1106",
    "rv1106b",
    "rv1126b",
    "rk2118",
    "rk3562",
    "rk3566",
    "rk3568",
    "rk3576",
    "rk3588",
)

DTYPE_PLATFORMS: dict[str, tuple[str, ...]] = {
    "w8a8": tuple(p for p in PLATFORMS if p != "rk2118"),
    "w4a16": ("rk3576", "rv1126b"),
    "w8a16": ("rk3562",),
    "w16a16i_dfp": ("rv1103", "rv1106"),
}

ALGORITHMS: dict[str, type[CalibrationMethod]] = {
    "normal": MinMaxMethod,
    "mmse": HistogramMSEMethod,
    "kl_divergence": HistogramEntropyMethod,
}

GROUP_METHODS = tuple(f"group{n}" for n in range(32, 257, 32))
METHODS = ("layer", "channel", *GROUP_METHODS)
OP_TARGETS = ("cpu", "npu", "gpu", "auto")
MEMORY_PLANS = ("BestFit", "GreedyBySize", "GreedyByLifetime", "SlowPeakGrowth")
COMPUTE_ORDERS = ("WidthFirst", "DepthFirst")
_PLACEMENT = {"cpu": "APU", "gpu": "CVU", "npu": "MLA"}


def _allowed(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(values)


_CHOICES: dict[str, tuple[str, ...]] = {
    "quantized_dtype": tuple(DTYPE_PLATFORMS),
    "quantized_method": METHODS,
    "memory_plan_strategy": MEMORY_PLANS,
    "compute_order": COMPUTE_ORDERS,
}
"""Fields whose value must be one of a fixed list (one validator checks them all)."""


class RknnConfig(BaseModel):
    """`rknn.config(...)` options that matter for quantization and compilation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_platform: str | None = Field(default=None, validate_default=True)
    mean_values: list[float] | list[list[float]] | None = None
    std_values: list[float] | list[list[float]] | None = None
    quant_img_RGB2BGR: bool | list[bool] = False
    quantized_dtype: str = "w8a8"
    quantized_algorithm: str = "normal"
    quantized_method: str = "channel"
    optimization_level: int = 3
    op_target: dict[str, str] | None = None
    auto_hybrid_cos_thresh: float = 0.98
    auto_hybrid_euc_thresh: float | None = None
    custom_string: str | None = None
    memory_plan_strategy: str = "BestFit"
    compute_order: str = "WidthFirst"
    single_core_mode: bool = False
    sparse_infer: bool = False
    compress_weight: bool = False
    remove_weight: bool = False
    dynamic_input: list[list[list[int]]] | None = None

    @field_validator("target_platform")
    @classmethod
    def _platform(cls, value: str | None) -> str:
        if value is None:
            raise ValueError(f"target_platform is required; one of {_allowed(PLATFORMS)}")
        key = value.lower()
        if key not in PLATFORMS:
            raise ValueError(
                f"target_platform {value!r} is not supported; one of {_allowed(PLATFORMS)}"
            )
        return key

    @field_validator(*_CHOICES)
    @classmethod
    def _one_of(cls, value: str, info: ValidationInfo) -> str:
        allowed = _CHOICES[info.field_name]
        if value not in allowed:
            raise ValueError(f"{info.field_name} {value!r}: one of {_allowed(allowed)}")
        return value

    @field_validator("quantized_algorithm")
    @classmethod
    def _algorithm(cls, value: str) -> str:
        if value not in ALGORITHMS:
            raise ValueError(
                f"quantized_algorithm {value!r}: one of {_allowed(list(ALGORITHMS))} (gdq is not implemented)"
            )
        return value

    @field_validator("optimization_level")
    @classmethod
    def _level(cls, value: int) -> int:
        if not 0 <= value <= 3:
            raise ValueError(f"optimization_level {value}: one of 0, 1, 2, 3")
        return value

    @field_validator("op_target")
    @classmethod
    def _op_target(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        bad = {k: v for k, v in value.items() if v not in OP_TARGETS}
        if bad:
            raise ValueError(f"op_target {bad}: each value is one of {_allowed(OP_TARGETS)}")
        return value

    @field_validator("auto_hybrid_cos_thresh")
    @classmethod
    def _cos(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"auto_hybrid_cos_thresh {value}: must be in (0, 1]")
        return value

    @field_validator("auto_hybrid_euc_thresh")
    @classmethod
    def _euc(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError(
                f"auto_hybrid_euc_thresh {value}: must be positive (or None to disable)"
            )
        return value

    @field_validator("mean_values", "std_values")
    @classmethod
    def _channels(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        lists = value if value and isinstance(value[0], list) else [value]
        for per_input in lists:
            if not 1 <= len(per_input) <= 4:
                raise ValueError(
                    f"{info.field_name}: each input takes 1 to 4 per-channel values, got {len(per_input)}"
                )
            if info.field_name == "std_values" and any(v == 0 for v in per_input):
                raise ValueError("std_values: values must be non-zero")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> RknnConfig:
        platforms = DTYPE_PLATFORMS[self.quantized_dtype]
        if self.target_platform not in platforms:
            raise ValueError(
                f"quantized_dtype {self.quantized_dtype!r} is not available on {self.target_platform}; "
                f"it is on {_allowed(platforms)}"
            )
        grouped = self.quantized_method.startswith("group")
        if grouped and self.quantized_dtype != "w4a16":
            raise ValueError(
                f"quantized_method {self.quantized_method!r} (group-wise) needs quantized_dtype 'w4a16'"
            )
        if self.quantized_dtype == "w4a16" and not grouped:
            raise ValueError(
                f"quantized_dtype 'w4a16' needs quantized_method one of {_allowed(GROUP_METHODS)}"
            )
        if self.single_core_mode and self.target_platform not in ("rk3588", "rk3576"):
            raise ValueError("single_core_mode is available on rk3588 and rk3576 only")
        if self.sparse_infer and self.target_platform not in ("rk3576", "rv1126b"):
            raise ValueError("sparse_infer is available on rk3576 and rv1126b only")
        if (
            self.mean_values is not None
            and self.std_values is not None
            and isinstance(self.mean_values[0], list) != isinstance(self.std_values[0], list)
        ):
            raise ValueError(
                "mean_values and std_values: give both per input (list of lists) or both flat"
            )
        return self

    # ---- conversion

    @property
    def target(self) -> str:
        """Target profile used for placement (only rk3588 has a profile today)."""
        from surgery.targets import available_targets

        assert self.target_platform is not None
        return self.target_platform if self.target_platform in available_targets() else "rk3588"

    def placement_pins(self) -> dict[str, str]:
        """op_target as coverage pins (tensor/node names or op types → MLA/CVU/APU); auto is dropped."""
        return {k: _PLACEMENT[v] for k, v in (self.op_target or {}).items() if v in _PLACEMENT}

    def _schemes(self) -> tuple[QuantizationScheme, QuantizationScheme]:
        per_channel = self.quantized_method != "layer"
        if self.quantized_dtype == "w8a8":
            return quantization_scheme(True, False, 8), quantization_scheme(False, per_channel, 8)
        if self.quantized_dtype == "w8a16":
            return float16_scheme(), quantization_scheme(False, per_channel, 8)
        if self.quantized_dtype == "w4a16":
            group = int(self.quantized_method.removeprefix("group"))
            return float16_scheme(), QuantizationScheme(False, True, bits=4, group_size=group)
        dfp_act = QuantizationScheme(False, False, bits=16, power_of_two=True)
        return dfp_act, QuantizationScheme(False, per_channel, bits=16, power_of_two=True)

    def to_quantization_params(self) -> QuantizationParams:
        activation, weight = self._schemes()
        return QuantizationParams(
            calibration_method=ALGORITHMS[self.quantized_algorithm](),
            activation_quantization_scheme=activation,
            weight_quantization_scheme=weight,
            requantization_mode=RequantizationMode.tflite,
        )

    def input_mean_std(self, index: int = 0) -> tuple[list[float] | None, list[float] | None]:
        """mean/std (pixel units) for model input `index`."""

        def pick(values: list[float] | list[list[float]] | None) -> list[float] | None:
            if values is None:
                return None
            if values and isinstance(values[0], list):
                return list(values[index]) if index < len(values) else None  # type: ignore[arg-type]
            return list(values)  # type: ignore[arg-type]

        return pick(self.mean_values), pick(self.std_values)

    def input_bgr(self, index: int = 0) -> bool:
        if isinstance(self.quant_img_RGB2BGR, list):
            return (
                bool(self.quant_img_RGB2BGR[index])
                if index < len(self.quant_img_RGB2BGR)
                else False
            )
        return self.quant_img_RGB2BGR
