"""The vendor-shaped settings: immutability, builders, validation, and the RKNN front door."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.defines import (
    CalibrationMethod,
    HistogramEntropyMethod,
    HistogramMSEMethod,
    HistogramPercentileMethod,
    MinMaxMethod,
    MovingAverageMinMaxMethod,
    QuantizationParams,
    QuantizationScheme,
    RequantizationMode,
    bfloat16_scheme,
    default_quantization,
    int16_quantization,
    quantization_scheme,
)
from compiler.quantize import RknnConfig


def test_default_quantization_matches_the_vendor_default() -> None:
    p = default_quantization
    assert p.calibration_method == HistogramMSEMethod()
    assert p.activation_quantization_scheme == quantization_scheme(
        asymmetric=True, per_channel=False, bits=8
    )
    assert p.weight_quantization_scheme == quantization_scheme(
        asymmetric=False, per_channel=True, bits=8
    )
    assert p.requantization_mode is RequantizationMode.sima
    assert int16_quantization.activation_quantization_scheme.bits == 16


def test_params_are_immutable_and_with_methods_copy() -> None:
    base = default_quantization
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.bias_correction = True  # type: ignore[misc]
    changed = (
        base.with_calibration(MinMaxMethod())
        .with_activation_quantization(quantization_scheme(False, False))
        .with_weight_quantization(quantization_scheme(False, False))
        .with_requantization_mode("tflite")
        .with_unquantized_nodes("a", ["b"])
        .with_custom_quantization_configs(
            {"c": {"activation_quantization_scheme": quantization_scheme(True, False, 16)}}
        )
        .with_bias_correction()
        .with_channel_equalization()
    )
    assert base == QuantizationParams()  # untouched
    assert changed.calibration_method == MinMaxMethod()
    assert changed.requantization_mode is RequantizationMode.tflite
    assert changed.unquantized_nodes == ("a", "b")
    assert changed.bias_correction and changed.channel_equalization
    assert changed.for_node("c").activation_quantization_scheme.bits == 16
    assert changed.for_node("other").activation_quantization_scheme.bits == 8
    with pytest.raises(TypeError):
        changed.custom_quantization_configs["d"] = {}  # type: ignore[index]
    assert dataclasses.replace(base, bias_correction=True).bias_correction
    assert hash(changed) == hash(QuantizationParams.from_dict(changed.to_dict()))
    assert QuantizationParams.from_dict(changed.to_dict()) == changed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mse", HistogramMSEMethod()),
        ("histogram_mse", HistogramMSEMethod()),
        ("min_max", MinMaxMethod()),
        ("MinMax", MinMaxMethod()),
        ("moving_average", MovingAverageMinMaxMethod()),
        ("entropy", HistogramEntropyMethod()),
        ("percentile", HistogramPercentileMethod()),
        ("kl_divergence", HistogramEntropyMethod()),
    ],
)
def test_calibration_method_from_str(text: str, expected: CalibrationMethod) -> None:
    assert CalibrationMethod.from_str(text) == expected


def test_method_parameters_and_positional_percentile() -> None:
    m = HistogramPercentileMethod(91.0, 2048)
    assert (m.percentile, m.num_bins) == (91.0, 2048)
    assert MovingAverageMinMaxMethod(momentum=0.5).momentum == 0.5
    assert CalibrationMethod.from_dict(m.to_dict()) == m


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CalibrationMethod.from_str("magic"), "calibration method"),
        (lambda: HistogramPercentileMethod(0.0), "percentile"),
        (lambda: HistogramPercentileMethod(100.5), "percentile"),
        (lambda: HistogramMSEMethod(num_bins=64), "num_bins"),
        (lambda: HistogramEntropyMethod(num_bins=100), "num_bins"),
        (lambda: MovingAverageMinMaxMethod(momentum=1.0), "momentum"),
        (lambda: quantization_scheme(True, False, bits=4), "bits"),
        (lambda: quantization_scheme(True, False, bits=12), "bits"),
        (
            lambda: default_quantization.with_weight_quantization(quantization_scheme(True, True)),
            "weight_quantization_scheme",
        ),
        (
            lambda: default_quantization.with_activation_quantization(
                quantization_scheme(True, True)
            ),
            "activation_quantization_scheme",
        ),
        (
            lambda: default_quantization.with_weight_quantization(bfloat16_scheme()),
            "weight_quantization_scheme",
        ),
        (lambda: default_quantization.with_requantization_mode("fast"), "requantization_mode"),
        (
            lambda: default_quantization.with_custom_quantization_configs({"n": {"bits": 8}}),
            "custom_quantization_configs",
        ),
        (lambda: QuantizationScheme(False, True, bits=4, group_size=40), "group_size"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_field(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_bfloat16_scheme_for_both() -> None:
    p = default_quantization.with_activation_quantization(
        bfloat16_scheme()
    ).with_weight_quantization(bfloat16_scheme())
    assert (
        p.activation_quantization_scheme.is_float
        and p.weight_quantization_scheme.kind == "bfloat16"
    )


# --------------------------------------------------------------------------- RKNN config


def test_rknn_config_converts_into_the_same_params() -> None:
    config = RknnConfig(
        target_platform="rk3588", quantized_algorithm="mmse", quantized_method="layer"
    )
    params = config.to_quantization_params()
    assert params.calibration_method == HistogramMSEMethod()
    assert params.activation_quantization_scheme == quantization_scheme(True, False, 8)
    assert params.weight_quantization_scheme == quantization_scheme(False, False, 8)
    assert (
        RknnConfig(target_platform="rk3588").to_quantization_params().calibration_method
        == MinMaxMethod()
    )
    assert (
        RknnConfig(target_platform="rk3588", quantized_algorithm="kl_divergence")
        .to_quantization_params()
        .calibration_method
        == HistogramEntropyMethod()
    )
    w4 = RknnConfig(
        target_platform="rk3576", quantized_dtype="w4a16", quantized_method="group64"
    ).to_quantization_params()
    assert (w4.weight_quantization_scheme.bits, w4.weight_quantization_scheme.group_size) == (4, 64)
    assert w4.activation_quantization_scheme.kind == "float16"
    dfp = RknnConfig(
        target_platform="rv1106", quantized_dtype="w16a16i_dfp"
    ).to_quantization_params()
    assert (
        dfp.activation_quantization_scheme.power_of_two
        and dfp.weight_quantization_scheme.bits == 16
    )
    assert RknnConfig(target_platform="rk3588").auto_hybrid_cos_thresh == 0.98
    assert RknnConfig(target_platform="rk3588").auto_hybrid_euc_thresh is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "target_platform"),
        ({"target_platform": "rk9999"}, "target_platform"),
        ({"target_platform": "rk2118"}, "quantized_dtype"),
        (
            {
                "target_platform": "rk3588",
                "quantized_dtype": "w4a16",
                "quantized_method": "group32",
            },
            "quantized_dtype",
        ),
        ({"target_platform": "rk3588", "quantized_dtype": "w8a16"}, "quantized_dtype"),
        ({"target_platform": "rk3588", "quantized_dtype": "w16a16i_dfp"}, "quantized_dtype"),
        ({"target_platform": "rk3588", "quantized_dtype": "int8"}, "quantized_dtype"),
        (
            {
                "target_platform": "rk3576",
                "quantized_dtype": "w4a16",
                "quantized_method": "channel",
            },
            "quantized_method",
        ),
        ({"target_platform": "rk3588", "quantized_method": "group64"}, "quantized_method"),
        ({"target_platform": "rk3588", "quantized_method": "group48"}, "quantized_method"),
        ({"target_platform": "rk3588", "quantized_algorithm": "gdq"}, "quantized_algorithm"),
        ({"target_platform": "rk3588", "optimization_level": 4}, "optimization_level"),
        ({"target_platform": "rk3588", "auto_hybrid_cos_thresh": 1.5}, "auto_hybrid_cos_thresh"),
        ({"target_platform": "rk3588", "auto_hybrid_euc_thresh": -1.0}, "auto_hybrid_euc_thresh"),
        ({"target_platform": "rk3588", "op_target": {"Conv_0": "tpu"}}, "op_target"),
        ({"target_platform": "rk3588", "std_values": [0, 1, 1]}, "std_values"),
        ({"target_platform": "rk3588", "mean_values": [1, 2, 3, 4, 5]}, "mean_values"),
        ({"target_platform": "rk3588", "memory_plan_strategy": "Fast"}, "memory_plan_strategy"),
        ({"target_platform": "rk3588", "compute_order": "Random"}, "compute_order"),
        ({"target_platform": "rk3566", "single_core_mode": True}, "single_core_mode"),
        ({"target_platform": "rk3588", "sparse_infer": True}, "sparse_infer"),
        ({"target_platform": "rk3588", "unknown_option": 1}, "unknown_option"),
    ],
)
def test_rknn_config_validation_matrix(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RknnConfig(**kwargs)


@pytest.mark.parametrize(
    ("platform", "dtype", "method"),
    [
        ("rv1103", "w8a8", "channel"),
        ("rk3588", "w8a8", "layer"),
        ("rk3576", "w4a16", "group256"),
        ("rv1126b", "w4a16", "group32"),
        ("rk3562", "w8a16", "channel"),
        ("rv1103", "w16a16i_dfp", "layer"),
        ("rv1106", "w16a16i_dfp", "channel"),
    ],
)
def test_rknn_config_valid_combinations(platform: str, dtype: str, method: str) -> None:
    config = RknnConfig(target_platform=platform, quantized_dtype=dtype, quantized_method=method)
    assert isinstance(config.to_quantization_params(), QuantizationParams)


def test_rknn_config_helpers() -> None:
    config = RknnConfig(
        target_platform="rk3588",
        mean_values=[[0, 0, 0], [1, 2, 3]],
        std_values=[[255, 255, 255], [1, 1, 1]],
        quant_img_RGB2BGR=[False, True],
        op_target={"Conv_3": "cpu", "Softmax": "npu", "x": "auto"},
    )
    assert config.input_mean_std(1) == ([1, 2, 3], [1, 1, 1])
    assert config.input_bgr(1) and not config.input_bgr(0)
    assert config.placement_pins() == {"Conv_3": "APU", "Softmax": "MLA"}
    assert config.target == "rk3588"
