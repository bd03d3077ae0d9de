"""Typed errors of the quantizer; both are ValueErrors so vendor-style callers can catch those."""

from __future__ import annotations

from surgery.errors import SurgeryError


class QuantizationError(SurgeryError, ValueError):
    """The model cannot be quantized as asked (a name that is not in the model, a scheme the
    target does not offer, an opset that cannot be converted, …)."""

    code = "quantization_error"


class CalibrationDataError(SurgeryError, ValueError):
    """Calibration data that cannot feed the model: empty, undecodable, wrong names or shapes."""

    code = "calibration_data"
