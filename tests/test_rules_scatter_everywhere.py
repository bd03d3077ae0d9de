"""scatter-everywhere-to-updates: a ScatterND whose indices list every element of its data
(torch's `attn[:, :, 0:, 0:] = …`, MViTv2 without a class token) is its updates."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.replace_slicing import writes_every_element
from tests.architectures import Builder

SHAPE = [1, 2, 6, 4]


def _assigned(indices: np.ndarray) -> onnx.ModelProto:
    """Two 1×1 Convs; the second's map written over the first's by ScatterND → Relu."""
    b = Builder()
    base = b.conv("base", "x", 2, 2, kernel=1, act=None)
    new = b.conv("new", "x", 2, 2, kernel=1, act=None)
    scattered = b.node("ScatterND", [base, b.const("indices", indices), new], "assign")
    b.node("Relu", [scattered], "y")
    return load_model(b.model("scatter", {"x": SHAPE}, ["y"], opset=16))


def _every_index(shape: list[int]) -> np.ndarray:
    grid = np.meshgrid(*(np.arange(d) for d in shape), indexing="ij")
    return np.stack(grid, axis=-1).astype(np.int64)


def test_a_scatter_of_every_element_is_its_updates() -> None:
    result = apply_rule(_assigned(_every_index(SHAPE)), "scatter-everywhere-to-updates")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "ScatterND" not in {n.op_type for n in result.model.graph.node}


def test_a_scatter_that_keeps_some_data_stays() -> None:
    indices = _every_index(SHAPE)
    indices[0, 0, 0, 0] = indices[0, 0, 0, 1]  # element (0, 0, 0, 0) of the data survives
    model = _assigned(indices)
    assert find_matches(model, "scatter-everywhere-to-updates") == []


def test_permuted_indices_do_not_count_as_in_place() -> None:
    indices = _every_index(SHAPE)[:, :, ::-1, :].copy()
    assert not writes_every_element(indices, SHAPE)
    assert writes_every_element(_every_index(SHAPE), SHAPE, sample=5)
