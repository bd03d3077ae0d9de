"""Tensors kept per frame by `run_archive(keep_tensors=True)` are stacked on axis 0, except a
0-d tensor (a scalar a host stage computes, as Swin-T's window-shift arithmetic does), which
has no frame axis to stack on: numpy refuses to concatenate it."""

from __future__ import annotations

import numpy as np

from compiler.runtime.pipeline import _stack_frames


def test_frames_of_a_map_stack_on_axis_0() -> None:
    frames = [np.zeros((1, 2, 3)), np.ones((1, 2, 3))]
    assert _stack_frames(frames).shape == (2, 2, 3)


def test_a_scalar_tensor_is_kept_as_a_scalar() -> None:
    assert _stack_frames([np.array(3.0)]).shape == ()
    assert _stack_frames([np.array(3.0), np.array(4.0)]) == 4.0
