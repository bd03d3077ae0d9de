"""Post-training quantization to QDQ ONNX: observers, calibration, schemes, CLE, bias correction."""

from compiler.quantize.data import CalibrationDataset, load_calibration_data
from compiler.quantize.errors import CalibrationDataError, QuantizationError
from compiler.quantize.quantizer import METADATA_KEY, QuantizedModel, quantize_model
from compiler.quantize.rknn_config import RknnConfig

__all__ = [
    "METADATA_KEY",
    "CalibrationDataError",
    "CalibrationDataset",
    "QuantizationError",
    "QuantizedModel",
    "RknnConfig",
    "load_calibration_data",
    "quantize_model",
]
