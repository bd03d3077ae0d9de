"""Quantization settings in the shape of SiMa's Palette API (`defines`).

Users coming from the vendor toolchain write `default_quantization.with_calibration(
HistogramPercentileMethod(91.0, 2048))` or `quantization_scheme(asymmetric=True,
per_channel=False)`; the same names work here. Everything is an immutable value: each
`with_*` returns a modified copy, so a shared default can never be changed by accident.

The rules the MLA imposes are checked when a value is built, not when the quantizer is half-way
through a model: weights are symmetric (zero point 0, so the integer conv needs no zero-point
correction term), activations are per tensor, integer widths are 8 or 16 bits (4 only for
group-wise weights, the RKNN w4a16 path). Whether the chosen target offers BF16 is checked at
quantize time, when the target is known.

The RKNN-style front door (`RknnConfig`) lives in `compiler.quantize.rknn_config` and converts
into the same `QuantizationParams`: one quantizer, two front doors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, Literal

MIN_HISTOGRAM_BINS = 128
"""Fewer bins than this cannot resolve a clipping threshold (TensorRT uses 2048)."""

INTEGER_BITS = (8, 16)
GROUP_SIZES = tuple(range(32, 257, 32))
"""Group sizes for 4-bit group-wise weights (RKNN `quantized_method` group32 … group256)."""

SchemeKind = Literal["int", "bfloat16", "float16"]


class RequantizationMode(str, Enum):
    """How int32 accumulators are brought back to 8/16 bits.

    The arithmetic of each mode (multiplier width, shift, rounding) is defined once by the
    reference integer executor in `compiler.runtime`; the quantizer only records the choice.
    `sima` is the MLA's native requantization, `tflite` follows TFLite's fixed-point
    multiplier with rounding half away from zero.
    """

    sima = "sima"
    tflite = "tflite"


# --------------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class QuantizationScheme:
    """How one class of tensors is represented: integer (width, granularity) or a float type.

    `group_size` (weights only) gives each run of `group_size` input channels its own scale;
    `power_of_two` restricts scales to 2**k (dynamic fixed point, RKNN's w16a16i_dfp).
    """

    asymmetric: bool
    per_channel: bool
    bits: int = 8
    kind: SchemeKind = "int"
    group_size: int | None = None
    power_of_two: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("int", "bfloat16", "float16"):
            raise ValueError(
                f"quantization scheme kind {self.kind!r}: expected int, bfloat16 or float16"
            )
        if self.kind != "int":
            if self.bits != 16 or self.asymmetric or self.per_channel or self.group_size:
                raise ValueError(f"a {self.kind} scheme is 16-bit, symmetric and per tensor")
            return
        if self.bits == 4:
            if self.group_size is None:
                raise ValueError(
                    "bits=4 is only available for group-wise weights (RKNN quantized_dtype='w4a16', "
                    "quantized_method='group32'…'group256')"
                )
            if self.asymmetric:
                raise ValueError("4-bit weights are symmetric")
        elif self.bits not in INTEGER_BITS:
            raise ValueError(
                f"bits={self.bits}: integer schemes use 8 or 16 bits (4 only for group-wise weights)"
            )
        if self.group_size is not None:
            if self.bits != 4:
                raise ValueError(
                    "group-wise quantization (group_size) is only available with 4-bit weights"
                )
            if self.group_size not in GROUP_SIZES:
                raise ValueError(
                    f"group_size={self.group_size}: allowed values are {', '.join(map(str, GROUP_SIZES))}"
                )

    @property
    def is_float(self) -> bool:
        return self.kind != "int"

    @property
    def qmin(self) -> int:
        """Smallest stored integer (storage is signed; asymmetric schemes add a zero point)."""
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def describe(self) -> str:
        if self.is_float:
            return self.kind
        parts = [f"int{self.bits}", "asymmetric" if self.asymmetric else "symmetric"]
        if self.group_size:
            parts.append(f"group{self.group_size}")
        else:
            parts.append("per-channel" if self.per_channel else "per-tensor")
        if self.power_of_two:
            parts.append("power-of-two scales")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationScheme:
        return cls(**dict(data))


def quantization_scheme(asymmetric: bool, per_channel: bool, bits: int = 8) -> QuantizationScheme:
    """An integer scheme. Integer widths are 8 or 16 bits."""
    if bits not in INTEGER_BITS:
        raise ValueError(
            f"bits={bits}: quantization_scheme takes 8 or 16 bits; 4-bit weights exist only group-wise "
            "(RknnConfig quantized_dtype='w4a16')"
        )
    return QuantizationScheme(asymmetric=bool(asymmetric), per_channel=bool(per_channel), bits=bits)


def bfloat16_scheme() -> QuantizationScheme:
    """BF16 instead of integers (targets whose MLA offers bf16, e.g. modalix)."""
    return QuantizationScheme(asymmetric=False, per_channel=False, bits=16, kind="bfloat16")


def float16_scheme() -> QuantizationScheme:
    """FP16 activations: the 'a16' of RKNN's w4a16 / w8a16 dtypes."""
    return QuantizationScheme(asymmetric=False, per_channel=False, bits=16, kind="float16")


# --------------------------------------------------------------------------- calibration methods


@dataclass(frozen=True)
class CalibrationMethod:
    """Base of the calibration methods; `from_str` accepts the usual spellings."""

    name: ClassVar[str] = ""
    uses_histogram: ClassVar[bool] = False

    @staticmethod
    def from_str(text: str) -> CalibrationMethod:
        key = str(text).strip().lower().replace("-", "_").replace(" ", "_")
        factory = _METHOD_ALIASES.get(key)
        if factory is None:
            raise ValueError(
                f"calibration method {text!r}: expected one of {', '.join(sorted(_METHOD_ALIASES))}"
            )
        return factory()

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> CalibrationMethod:
        values = dict(data)
        name = values.pop("method", None)
        cls = _METHODS_BY_NAME.get(str(name))
        if cls is None:
            raise ValueError(
                f"calibration method {name!r}: expected one of {', '.join(_METHODS_BY_NAME)}"
            )
        return cls(**values)


@dataclass(frozen=True)
class MinMaxMethod(CalibrationMethod):
    """Range = smallest and largest value seen. Fast; a single outlier widens every step."""

    name: ClassVar[str] = "min_max"


@dataclass(frozen=True)
class MovingAverageMinMaxMethod(CalibrationMethod):
    """Exponential moving average of each sample's min and max (the first sample initialises).

    A true EMA, m = momentum·m + (1 − momentum)·x, not the plain mean some tools give this name.
    """

    name: ClassVar[str] = "moving_average_min_max"
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.momentum, bool) or not 0.0 <= float(self.momentum) < 1.0:
            raise ValueError(f"momentum={self.momentum!r}: must be in [0, 1)")


@dataclass(frozen=True)
class _HistogramMethod(CalibrationMethod):
    """Methods that keep a fixed-bin histogram per tensor and choose the range from it.

    Each subclass declares its own `num_bins` field so that positional arguments follow the
    vendor order (`HistogramPercentileMethod(percentile, num_bins)`).
    """

    uses_histogram: ClassVar[bool] = True

    def __post_init__(self) -> None:
        bins = getattr(self, "num_bins", None)
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < MIN_HISTOGRAM_BINS:
            raise ValueError(
                f"num_bins={bins!r}: needs an integer ≥ {MIN_HISTOGRAM_BINS}; fewer bins cannot "
                "place a clipping threshold inside the range"
            )


@dataclass(frozen=True)
class HistogramMSEMethod(_HistogramMethod):
    """Range minimising the expected quantization MSE (clipping plus rounding noise). Default."""

    name: ClassVar[str] = "histogram_mse"
    num_bins: int = 2048


@dataclass(frozen=True)
class HistogramEntropyMethod(_HistogramMethod):
    """Threshold minimising the KL divergence between float and quantized distributions."""

    name: ClassVar[str] = "histogram_entropy"
    num_bins: int = 2048


@dataclass(frozen=True)
class HistogramPercentileMethod(_HistogramMethod):
    """Range between the (100 − p)-th and p-th percentiles: `HistogramPercentileMethod(91.0, 2048)`."""

    name: ClassVar[str] = "histogram_percentile"
    percentile: float = 99.99
    num_bins: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.percentile, bool) or not 0.0 < float(self.percentile) <= 100.0:
            raise ValueError(f"percentile={self.percentile!r}: must be in (0, 100]")


_METHODS_BY_NAME: dict[str, type[CalibrationMethod]] = {
    c.name: c
    for c in (
        MinMaxMethod,
        MovingAverageMinMaxMethod,
        HistogramMSEMethod,
        HistogramEntropyMethod,
        HistogramPercentileMethod,
    )
}

_METHOD_ALIASES: dict[str, Callable[[], CalibrationMethod]] = {
    "min_max": MinMaxMethod,
    "minmax": MinMaxMethod,
    "max": MinMaxMethod,
    "moving_average": MovingAverageMinMaxMethod,
    "moving_average_min_max": MovingAverageMinMaxMethod,
    "movingaverageminmax": MovingAverageMinMaxMethod,
    "ema": MovingAverageMinMaxMethod,
    "mse": HistogramMSEMethod,
    "mmse": HistogramMSEMethod,
    "histogram_mse": HistogramMSEMethod,
    "histogrammse": HistogramMSEMethod,
    "entropy": HistogramEntropyMethod,
    "kl": HistogramEntropyMethod,
    "kl_divergence": HistogramEntropyMethod,
    "histogram_entropy": HistogramEntropyMethod,
    "histogramentropy": HistogramEntropyMethod,
    "percentile": HistogramPercentileMethod,
    "histogram_percentile": HistogramPercentileMethod,
    "histogrampercentile": HistogramPercentileMethod,
}


# --------------------------------------------------------------------------- per-node settings


@dataclass(frozen=True)
class NodeQuantizationConfig:
    """Partial settings for one node; None keeps the model-wide value."""

    calibration_method: CalibrationMethod | None = None
    activation_quantization_scheme: QuantizationScheme | None = None
    weight_quantization_scheme: QuantizationScheme | None = None

    FIELDS: ClassVar[tuple[str, ...]] = (
        "calibration_method",
        "activation_quantization_scheme",
        "weight_quantization_scheme",
    )

    @classmethod
    def coerce(cls, node: str, value: Any) -> NodeQuantizationConfig:
        """Accept a NodeQuantizationConfig, a QuantizationParams or a dict of partial settings."""
        where = f"custom_quantization_configs[{node!r}]"
        if isinstance(value, NodeQuantizationConfig):
            return value
        if isinstance(value, QuantizationParams):
            return cls(
                value.calibration_method,
                value.activation_quantization_scheme,
                value.weight_quantization_scheme,
            )
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{where}: expected a dict with keys {', '.join(cls.FIELDS)}, got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(cls.FIELDS))
        if unknown:
            raise ValueError(
                f"{where}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(cls.FIELDS)}"
            )
        method = value.get("calibration_method")
        return cls(
            _coerce_method(method, where) if method is not None else None,
            _coerce_scheme(value.get("activation_quantization_scheme"), where),
            _coerce_scheme(value.get("weight_quantization_scheme"), where),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "calibration_method": self.calibration_method.to_dict()
            if self.calibration_method
            else None,
            "activation_quantization_scheme": _scheme_dict(self.activation_quantization_scheme),
            "weight_quantization_scheme": _scheme_dict(self.weight_quantization_scheme),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeQuantizationConfig:
        method = data.get("calibration_method")
        act = data.get("activation_quantization_scheme")
        wgt = data.get("weight_quantization_scheme")
        return cls(
            CalibrationMethod.from_dict(method) if method else None,
            QuantizationScheme.from_dict(act) if act else None,
            QuantizationScheme.from_dict(wgt) if wgt else None,
        )


def _scheme_dict(scheme: QuantizationScheme | None) -> dict[str, Any] | None:
    return scheme.to_dict() if scheme is not None else None


def _coerce_method(value: Any, where: str) -> CalibrationMethod:
    if isinstance(value, CalibrationMethod):
        return value
    if isinstance(value, str):
        return CalibrationMethod.from_str(value)
    raise ValueError(
        f"{where}: calibration_method must be a CalibrationMethod or a name, got {value!r}"
    )


def _coerce_scheme(value: Any, where: str) -> QuantizationScheme | None:
    if value is None or isinstance(value, QuantizationScheme):
        return value
    if isinstance(value, Mapping):
        return QuantizationScheme.from_dict(value)
    raise ValueError(
        f"{where}: expected a QuantizationScheme (see quantization_scheme()), got {value!r}"
    )


# --------------------------------------------------------------------------- the whole configuration


def _default_activation_scheme() -> QuantizationScheme:
    return quantization_scheme(asymmetric=True, per_channel=False)


def _default_weight_scheme() -> QuantizationScheme:
    return quantization_scheme(asymmetric=False, per_channel=True)


@dataclass(frozen=True)
class QuantizationParams:
    """Everything the quantizer needs besides the model, the data and the target."""

    calibration_method: CalibrationMethod = field(default_factory=HistogramMSEMethod)
    activation_quantization_scheme: QuantizationScheme = field(
        default_factory=_default_activation_scheme
    )
    weight_quantization_scheme: QuantizationScheme = field(default_factory=_default_weight_scheme)
    requantization_mode: RequantizationMode = RequantizationMode.sima
    unquantized_nodes: tuple[str, ...] = ()
    custom_quantization_configs: Mapping[str, NodeQuantizationConfig] = field(default_factory=dict)
    bias_correction: bool = False
    channel_equalization: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(
            self,
            "calibration_method",
            _coerce_method(self.calibration_method, "QuantizationParams"),
        )
        try:
            set_(self, "requantization_mode", RequantizationMode(self.requantization_mode))
        except ValueError:
            raise ValueError(
                f"requantization_mode={self.requantization_mode!r}: expected one of "
                f"{', '.join(m.value for m in RequantizationMode)}"
            ) from None
        nodes = (
            (self.unquantized_nodes,)
            if isinstance(self.unquantized_nodes, str)
            else self.unquantized_nodes
        )
        set_(self, "unquantized_nodes", tuple(str(n) for n in nodes))
        customs = {
            str(k): NodeQuantizationConfig.coerce(str(k), v)
            for k, v in dict(self.custom_quantization_configs).items()
        }
        set_(self, "custom_quantization_configs", MappingProxyType(customs))
        set_(self, "bias_correction", bool(self.bias_correction))
        set_(self, "channel_equalization", bool(self.channel_equalization))
        check_schemes(
            self.activation_quantization_scheme,
            self.weight_quantization_scheme,
            "QuantizationParams",
        )
        for name, cfg in customs.items():
            check_schemes(
                cfg.activation_quantization_scheme or self.activation_quantization_scheme,
                cfg.weight_quantization_scheme or self.weight_quantization_scheme,
                f"custom_quantization_configs[{name!r}]",
            )

    def __hash__(self) -> int:
        return hash(
            (
                self.calibration_method,
                self.activation_quantization_scheme,
                self.weight_quantization_scheme,
                self.requantization_mode,
                self.unquantized_nodes,
                tuple(sorted(self.custom_quantization_configs.items(), key=lambda kv: kv[0])),
                self.bias_correction,
                self.channel_equalization,
            )
        )

    # ---- copies with one thing changed (the vendor API's builder methods)

    def with_calibration(self, method: CalibrationMethod | str) -> QuantizationParams:
        return dataclasses.replace(
            self, calibration_method=_coerce_method(method, "with_calibration")
        )

    def with_activation_quantization(self, scheme: QuantizationScheme) -> QuantizationParams:
        return dataclasses.replace(self, activation_quantization_scheme=scheme)

    def with_weight_quantization(self, scheme: QuantizationScheme) -> QuantizationParams:
        return dataclasses.replace(self, weight_quantization_scheme=scheme)

    def with_requantization_mode(self, mode: RequantizationMode | str) -> QuantizationParams:
        return dataclasses.replace(self, requantization_mode=mode)

    def with_unquantized_nodes(self, *names: str | Iterable[str]) -> QuantizationParams:
        flat: list[str] = []
        for n in names:
            flat.extend([n] if isinstance(n, str) else n)
        return dataclasses.replace(
            self, unquantized_nodes=tuple(dict.fromkeys((*self.unquantized_nodes, *flat)))
        )

    def with_custom_quantization_configs(self, configs: Mapping[str, Any]) -> QuantizationParams:
        return dataclasses.replace(
            self, custom_quantization_configs={**self.custom_quantization_configs, **configs}
        )

    def with_bias_correction(self, on: bool = True) -> QuantizationParams:
        return dataclasses.replace(self, bias_correction=on)

    def with_channel_equalization(self, on: bool = True) -> QuantizationParams:
        return dataclasses.replace(self, channel_equalization=on)

    # ---- per-node view and serialisation

    def for_node(self, name: str) -> NodeQuantizationConfig:
        """The effective, fully resolved settings of one node."""
        custom = self.custom_quantization_configs.get(name) or NodeQuantizationConfig()
        return NodeQuantizationConfig(
            custom.calibration_method or self.calibration_method,
            custom.activation_quantization_scheme or self.activation_quantization_scheme,
            custom.weight_quantization_scheme or self.weight_quantization_scheme,
        )

    def all_schemes(self) -> list[QuantizationScheme]:
        """Model-wide and per-node schemes (to decide the opset or check target precisions)."""
        schemes = [self.activation_quantization_scheme, self.weight_quantization_scheme]
        for cfg in self.custom_quantization_configs.values():
            schemes += [
                s for s in (cfg.activation_quantization_scheme, cfg.weight_quantization_scheme) if s
            ]
        return schemes

    def to_dict(self) -> dict[str, Any]:
        return {
            "calibration_method": self.calibration_method.to_dict(),
            "activation_quantization_scheme": self.activation_quantization_scheme.to_dict(),
            "weight_quantization_scheme": self.weight_quantization_scheme.to_dict(),
            "requantization_mode": self.requantization_mode.value,
            "unquantized_nodes": list(self.unquantized_nodes),
            "custom_quantization_configs": {
                k: v.to_dict() for k, v in self.custom_quantization_configs.items()
            },
            "bias_correction": self.bias_correction,
            "channel_equalization": self.channel_equalization,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationParams:
        return cls(
            calibration_method=CalibrationMethod.from_dict(data["calibration_method"]),
            activation_quantization_scheme=QuantizationScheme.from_dict(
                data["activation_quantization_scheme"]
            ),
            weight_quantization_scheme=QuantizationScheme.from_dict(
                data["weight_quantization_scheme"]
            ),
            requantization_mode=RequantizationMode(data["requantization_mode"]),
            unquantized_nodes=tuple(data.get("unquantized_nodes", ())),
            custom_quantization_configs={
                k: NodeQuantizationConfig.from_dict(v)
                for k, v in data.get("custom_quantization_configs", {}).items()
            },
            bias_correction=bool(data.get("bias_correction", False)),
            channel_equalization=bool(data.get("channel_equalization", False)),
        )


def check_schemes(activation: Any, weight: Any, where: str) -> None:
    """The MLA's rules on scheme combinations; raises ValueError naming the offending field."""
    if not isinstance(activation, QuantizationScheme):
        raise ValueError(
            f"{where}: activation_quantization_scheme must be a QuantizationScheme, got {activation!r}"
        )
    if not isinstance(weight, QuantizationScheme):
        raise ValueError(
            f"{where}: weight_quantization_scheme must be a QuantizationScheme, got {weight!r}"
        )
    if activation.per_channel:
        raise ValueError(
            f"{where}: activation_quantization_scheme is per-channel; activations are quantized per tensor"
        )
    if activation.group_size is not None or (activation.kind == "int" and activation.bits == 4):
        raise ValueError(
            f"{where}: activation_quantization_scheme: 4-bit and group-wise apply to weights only"
        )
    if weight.asymmetric:
        raise ValueError(
            f"{where}: weight_quantization_scheme is asymmetric; weights are quantized symmetrically "
            "(zero point 0), per tensor or per channel"
        )
    if weight.is_float and not activation.is_float:
        raise ValueError(
            f"{where}: weight_quantization_scheme is {weight.kind} but activations are integer; "
            f"use {weight.kind} for both (e.g. bfloat16_scheme() for activations and weights)"
        )
    if weight.bits == 4 and not activation.is_float:
        raise ValueError(
            f"{where}: 4-bit group-wise weights go with float16 activations (RKNN w4a16)"
        )


default_quantization = QuantizationParams()
"""HistogramMSE calibration, asymmetric per-tensor int8 activations, symmetric per-channel int8 weights."""

int16_quantization = QuantizationParams(
    activation_quantization_scheme=quantization_scheme(asymmetric=True, per_channel=False, bits=16),
    weight_quantization_scheme=quantization_scheme(asymmetric=False, per_channel=True, bits=8),
)
"""16-bit activations (asymmetric per tensor) with 8-bit per-channel weights (A16W8)."""

from compiler.lower.tessellate import TensorDRAMLayout, TensorTessellateParameters  # noqa: E402

__all__ = [
    "TensorDRAMLayout",
    "TensorTessellateParameters",
    "CalibrationMethod",
    "HistogramEntropyMethod",
    "HistogramMSEMethod",
    "HistogramPercentileMethod",
    "MinMaxMethod",
    "MovingAverageMinMaxMethod",
    "NodeQuantizationConfig",
    "QuantizationParams",
    "QuantizationScheme",
    "RequantizationMode",
    "bfloat16_scheme",
    "check_schemes",
    "default_quantization",
    "float16_scheme",
    "int16_quantization",
    "quantization_scheme",
]
