"""`run_notes`: what a reader of a run's outputs should know (inputs cast, constant outputs)."""

from __future__ import annotations

import numpy as np

from compiler.runtime.pipeline import run_notes

NODES = [{"name": "x", "dtype": "float32"}]


def test_a_run_of_float_inputs_and_varied_outputs_has_no_notes():
    outputs = {"y": np.arange(4, dtype=np.float32)}
    assert run_notes(NODES, {"x": np.zeros(3, np.float32)}, outputs) == []


def test_an_input_of_another_dtype_is_noted_as_cast():
    notes = run_notes(NODES, {"x": np.zeros(3, np.uint8)}, {})
    assert notes == ["input 'x' cast from uint8 to float32"]


def test_an_output_of_one_value_everywhere_is_noted():
    outputs = {"map": np.zeros((1, 1, 8, 8), np.float32), "score": np.array([0.0], np.float32)}
    (note,) = run_notes(NODES, {"x": np.zeros(3, np.float32)}, outputs)
    assert note.startswith("output 'map' holds one value only (0 everywhere)")
