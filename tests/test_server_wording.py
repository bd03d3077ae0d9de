"""Core messages name CLI commands and flags; the server says them as its tools."""

from __future__ import annotations

from server.errors import describe_error
from server.wording import tool_words
from surgery.errors import ShapeError


def test_a_flag_becomes_the_tool_parameter() -> None:
    reason = "input 'x' has dynamic shape [?, 3]; the MLA needs static shapes (use --input-shape)"
    assert tool_words(reason).endswith("(use input_shapes)")


def test_commands_become_tool_names() -> None:
    hint = "quantize it first: surgery quantize MODEL --calib DATA; see `surgery inspect`"
    assert tool_words(hint) == "quantize it first: quantize_model; see find_nodes / inspect_node"


def test_tool_errors_are_worded_for_tools() -> None:
    error = ShapeError("no input 'y'", hint="--input-shape names the model's inputs")
    assert (
        describe_error(error)
        == "shape_error: no input 'y'\nhint: input_shapes names the model's inputs"
    )


def test_text_without_cli_references_is_unchanged() -> None:
    assert tool_words("input is rank 3; the MLA needs 4-D tensors") == (
        "input is rank 3; the MLA needs 4-D tensors"
    )
