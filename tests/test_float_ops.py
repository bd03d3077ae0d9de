"""Float host stages run through onnx.reference with our replacement kernels (FLOAT_OP_OVERRIDES)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from compiler.runtime.program import FloatStep


def _gather_elements(axis: int) -> FloatStep:
    node = helper.make_node("GatherElements", ["data", "index"], ["out"], axis=axis)
    return FloatStep(node, {"": 17}, [], "test")


def test_gather_elements_takes_rows_along_an_axis_longer_than_64() -> None:
    rng = np.random.default_rng(0)
    data = rng.random((1, 8400, 6)).astype(np.float32)
    index = rng.integers(0, 8400, (1, 100, 6))
    values = {"data": data, "index": index}
    _gather_elements(1).run(values)
    np.testing.assert_array_equal(values["out"], np.take_along_axis(data, index, axis=1))


def test_gather_elements_counts_negative_indices_from_the_end() -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    values = {"data": data, "index": np.array([[-1, 0, 1, -3]])}
    _gather_elements(0).run(values)
    np.testing.assert_array_equal(values["out"], [[8, 1, 6, 3]])
