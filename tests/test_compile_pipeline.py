"""End to end: compile_model -> run_archive equals the integer reference executor, bit for bit.

Under every memory strategy, both compute orders, batch 1 and > 1, and both tessellation paths
(CVU tessellate/detessellate stages, or the MLA reading HWC / writing HWC16 directly).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.lower.errors import CompileError
from compiler.lower.memory import STRATEGIES
from compiler.lower.tessellate import TensorDRAMLayout, TensorTessellateParameters
from compiler.runtime.pipeline import run_archive
from tests.lower_support import compile_configured, input_frames, load_example, reference_outputs

ORDERS = ("WidthFirst", "DepthFirst")
FULL = list(itertools.product(STRATEGIES, ORDERS, (1, 3), (None, "default")))
REDUCED = [(s, o, 1, None) for s, o in itertools.product(STRATEGIES, ORDERS)] + [
    ("BestFit", "WidthFirst", 2, "default"),
    ("SlowPeakGrowth", "DepthFirst", 3, None),
]
FRAMES = 4


def _check(name: str, strategy: str, order: str, batch: int, tessellate, tmp_path) -> None:
    model = load_example(name)
    result = compile_configured(model, tmp_path, name, strategy, order, batch, tessellate)
    assert result.actual_batch_size == batch
    feeds = input_frames(model, FRAMES)
    outputs, stats = run_archive(result.archive, feeds, keep_tensors=True)
    reference = reference_outputs(model, feeds, FRAMES)
    float_host = any(s.processor == "APU" for s in result.compiled.stages)
    for output, value in reference.items():
        if float_host:  # ONNX Runtime vs onnx.reference float rounding in APU stages
            np.testing.assert_allclose(outputs[output], value, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(outputs[output], value, err_msg=output)
    assert_mla_stages_bit_exact(result, stats.tensors, FRAMES)
    for segment in result.segments:
        assert segment["peak_bytes"] >= segment["lower_bound_bytes"] > 0
        assert segment["cycles"] > 0


def assert_mla_stages_bit_exact(result, tensors, frames: int) -> None:
    """Each MLA stage's outputs equal its integer steps run on the same (pipeline) inputs."""
    partition = result.compiled.partition

    def frame(name: str, k: int) -> np.ndarray:
        """Frame k of a pipeline tensor (frames are stacked on axis 0)."""
        rows = tensors[name].shape[0] // frames
        return tensors[name][k * rows : (k + 1) * rows]

    for stage in partition.mla_stages:
        for k in range(frames):
            values = dict(partition.constants)
            values.update({n: frame(n, k) for n in stage.inputs})
            for step in stage.steps:
                step.run(values)
            for name in stage.outputs:
                np.testing.assert_array_equal(frame(name, k), values[name], err_msg=name)


@pytest.mark.parametrize(("strategy", "order", "batch", "tessellate"), FULL)
@pytest.mark.parametrize("name", ["plain_cnn", "cnn_with_topk"])
def test_small_fixtures_bit_exact_everywhere(name, strategy, order, batch, tessellate, tmp_path):
    _check(name, strategy, order, batch, tessellate, tmp_path)


@pytest.mark.parametrize(("strategy", "order", "batch", "tessellate"), REDUCED)
@pytest.mark.parametrize("name", ["yolo_head", "yolov5_head", "transformer_block"])
def test_larger_fixtures_bit_exact(name, strategy, order, batch, tessellate, tmp_path):
    _check(name, strategy, order, batch, tessellate, tmp_path)


def test_batch_16_becomes_12_when_only_12_fit(tmp_path) -> None:
    model = load_example("plain_cnn")
    one = compile_model(model, tmp_path / "one", model_name="m")
    per_frame = one.segments[0]["peak_bytes"]
    result = compile_model(
        model,
        tmp_path / "b",
        model_name="m",
        batch_size=16,
        arena_bytes=12 * per_frame + per_frame // 2,
    )
    assert (result.desired_batch_size, result.actual_batch_size) == (16, 12)
    archive = read_archive(result.archive)
    assert (archive.desired_batch_size, archive.actual_batch_size) == (16, 12)
    assert archive.programs["MLA_0"].metadata.batch_size == 12
    assert any("16 requested, 12 compiled" in note for note in result.notes)
    feeds = input_frames(model, 13)
    outputs, stats = run_archive(result.archive, feeds)
    np.testing.assert_array_equal(outputs["logits"], reference_outputs(model, feeds, 13)["logits"])
    mla = next(s for s in stats.stages if s.processor == "MLA")
    assert (mla.invocations, mla.frames) == (2, 13)


def test_spilling_to_dram_when_one_frame_does_not_fit(tmp_path) -> None:
    model = load_example("yolo_head")
    result = compile_model(model, tmp_path, model_name="m", arena_bytes=8192)
    (segment,) = result.segments
    assert segment["spilled_tensors"] > 0 and segment["peak_bytes"] <= 8192
    assert result.actual_batch_size == 1
    feeds = input_frames(model, 2)
    outputs, _ = run_archive(result.archive, feeds)
    np.testing.assert_array_equal(outputs["output0"], reference_outputs(model, feeds, 2)["output0"])


def test_mla_side_tessellation_drops_the_cvu_reorder_stages_and_is_faster(tmp_path) -> None:
    model = load_example("plain_cnn")
    feeds = input_frames(model, 2)
    default = compile_model(model, tmp_path / "cvu", model_name="m")
    params = {
        "input": TensorTessellateParameters((1, 16, 16, 16), True, TensorDRAMLayout.HWC),
        "logits": TensorTessellateParameters(dram_layout=TensorDRAMLayout.HWC16),
    }
    direct = compile_model(model, tmp_path / "mla", model_name="m", tessellate_parameters=params)
    kernels = lambda r: [s["kernel"] for s in r.stages]  # noqa: E731
    assert kernels(default) == ["quantize", "tessellate", "mla", "detessellate", "dequantize"]
    assert kernels(direct) == ["quantize", "mla", "dequantize"]
    document = read_archive(direct.archive).manifest
    assert document["input_nodes"][0]["layout"] == "HWC"
    assert document["output_nodes"][0]["layout"] == "HWC16"
    results = {}
    for result in (default, direct):
        outputs, stats = run_archive(result.archive, feeds)
        results[result is direct] = (outputs["logits"], stats.latency_us_per_frame)
    np.testing.assert_array_equal(results[True][0], results[False][0])
    assert results[True][1] < results[False][1]


def test_single_core_mode_uses_one_quad(tmp_path) -> None:
    result = compile_model(
        load_example("plain_cnn"), tmp_path, model_name="m", single_core_mode=True
    )
    archive = read_archive(result.archive)
    program = archive.programs["MLA_0"]
    assert program.metadata.quads == 1
    mla = next(p for p in archive.plugins if p["processor"] == "MLA")
    assert mla["config_params"]["number_of_quads_to_user"] == 1
    four = compile_model(load_example("plain_cnn"), tmp_path / "4", model_name="m")
    assert result.segments[0]["cycles"] > four.segments[0]["cycles"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"memory_plan_strategy": "Optimal"}, "BestFit"),
        ({"compute_order": "Random"}, "WidthFirst"),
        ({"batch_size": 0}, "batch_size"),
        ({"tessellate_parameters": {"nope": TensorTessellateParameters()}}, "nope"),
        ({"tessellate_parameters": "everything"}, "default"),
        ({"target": "no_such_target"}, "no_such_target"),
    ],
)
def test_bad_options_are_clear_errors(options, message, tmp_path) -> None:
    from surgery.errors import SurgeryError

    with pytest.raises(SurgeryError, match=message):
        compile_model(load_example("plain_cnn"), tmp_path, model_name="m", **options)


def test_tile_shape_is_validated() -> None:
    with pytest.raises(CompileError, match="tile_shape"):
        TensorTessellateParameters((0, 4))
    assert TensorTessellateParameters((8, 8, 16)).tile_shape == (1, 8, 8, 16)
    assert TensorTessellateParameters(dram_layout="hwc16").dram_layout is TensorDRAMLayout.HWC16


def test_float_and_dynamic_models_are_refused(tmp_path) -> None:
    from surgery import examples

    with pytest.raises(CompileError, match="not a quantized"):
        compile_model(examples.plain_cnn(), tmp_path)
    dynamic = load_example("plain_cnn")
    dim = dynamic.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_param = "batch"
    with pytest.raises(CompileError, match="dynamic shape"):
        compile_model(dynamic, tmp_path)


def test_a_target_without_mla_geometry_is_compiled_for_the_default_mla(tmp_path) -> None:
    model = load_example("plain_cnn")
    assert compile_model(model, tmp_path / "rk", target="rk3588").to_dict()["default_mla"]
    assert not compile_model(model, tmp_path / "modalix", target="modalix").default_mla
