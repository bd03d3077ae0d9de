"""Planned steps (`compiler.runtime.emulator_plans`) change no bit and no byte count.

The reference comparisons of test_emulator_compute / test_emulator_movement run through the
planned steps (their cases are small); test_emulator_fastpaths runs the same comparisons with
planning off, through the blockwise executors. Here whole compiled programs run both ways, and
a planned image is reused across runs with different inputs.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.isa import Conv, Move, Requant, Space
from compiler.runtime import emulator_ops, emulator_plans
from compiler.runtime.emulator import Emulator, EmulatorError
from tests.lower_support import load_example
from tests.test_emulator_compute import test_eltwise_matches_reference
from tests.test_emulator_support import Codegen, random_codes

EXAMPLES = ["plain_cnn", "yolo_head", "yolov5_head", "transformer_block", "cnn_with_topk"]


def _programs(name: str) -> list[bytes]:
    with tempfile.TemporaryDirectory() as folder:
        archive = read_archive(compile_model(load_example(name), folder, model_name=name).archive)
        return [archive.executable(p) for p in archive.plugins if p["processor"] == "MLA"]


def _random_inputs(emulator: Emulator, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        info.name: random_codes(rng, info.tensor.shape, info.tensor.dtype.numpy.name)
        for info in emulator.program.metadata.inputs
    }


def _run(data: bytes, inputs: dict[str, np.ndarray], planned: bool, monkeypatch) -> Emulator:
    monkeypatch.setattr(emulator_plans, "PLANNED", planned)
    emulator = Emulator(data)
    emulator.run(inputs)
    return emulator


@pytest.mark.parametrize("name", EXAMPLES)
def test_planned_programs_equal_the_executors(name: str, monkeypatch) -> None:
    for data in _programs(name):
        inputs = _random_inputs(Emulator(data), seed=3)
        executed = _run(data, inputs, False, monkeypatch)
        expected = {k: v.copy() for k, v in executed.run(inputs).items()}
        planned = _run(data, inputs, True, monkeypatch)
        assert any(not hasattr(step, "func") for step in planned.memory.plan.steps)
        for key, value in planned.run(inputs).items():
            assert value.dtype == expected[key].dtype
            np.testing.assert_array_equal(value, expected[key])
        assert planned.stats.bytes_read == executed.stats.bytes_read
        assert planned.stats.bytes_written == executed.stats.bytes_written


def test_planned_eltwise_looks_up_every_code_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference comparisons of ELTWISE with every planned step of two 8-bit operands a
    lookup in the table of every code pair (it pays at once)."""
    monkeypatch.setattr(emulator_ops, "TABLE_FACTOR", 0)
    test_eltwise_matches_reference()


def test_a_kept_table_pays_over_the_evaluations_under_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(emulator_ops, "TABLE_FACTOR", 2)
    monkeypatch.setattr(emulator_ops, "_DEMAND", {})
    assert not emulator_ops.table_pays(("kept", 1), 300, 256)
    assert emulator_ops.table_pays(("kept", 1), 300, 256)  # 600 elements >= 2 per entry
    assert not emulator_ops.table_pays(("kept", 2), 300, 256)
    assert not emulator_ops.table_pays(None, 300, 256)  # not kept: each evaluation alone
    assert not emulator_ops.table_pays(None, 300, 256)
    assert emulator_ops.table_pays(None, 512, 256)


def test_a_planned_image_holds_no_state_between_runs() -> None:
    (data,) = _programs("plain_cnn")
    first = Emulator(data)
    inputs = [_random_inputs(first, seed) for seed in range(3)]
    (output,) = first.output_names
    results = [first.run(feed)[output] for feed in inputs]
    plan = first.memory.plan
    again = [first.run(feed)[output] for feed in reversed(inputs)]
    assert first.memory.plan is plan
    for result, expected in zip(again, reversed(results), strict=True):
        np.testing.assert_array_equal(result, expected)
    assert not np.array_equal(results[0], results[1])


def test_a_wrong_small_instruction_fails_in_program_order() -> None:
    build = Codegen()
    x = build.input("x", (1, 2, 3, 3), "int8", Space.ARENA)
    hidden = build.alloc((1, 2, 3, 3), "int8")
    build.emit(Move(src=x, dst=hidden))
    build.emit(
        Conv(
            input=hidden,
            weight=build.const(np.ones((4, 2, 1, 1)), "int8"),
            output=build.output("y", (1, 4, 2, 2), "int8"),
            requant=Requant(1 << 30, 31, 0, -128, 127),
        )
    )
    emulator = Emulator(build.program())
    with pytest.raises(EmulatorError, match=r"instruction 1 \(CONV.*the CONV output"):
        emulator.run({"x": np.zeros((1, 2, 3, 3), np.int8)})
