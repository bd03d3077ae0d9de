"""`surgery inspect` on a terminal: focused queries render as text (JSON only with --json)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from server.cli import app

runner = CliRunner()


@pytest.fixture
def yolo(yolo_head, save):
    return save(yolo_head)


def _inspect(path, *args: str):
    return runner.invoke(app, ["inspect", str(path), *args])


def test_a_node_renders_as_a_table_of_its_tensors(yolo) -> None:
    result = _inspect(yolo, "--node", "split_36")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("split_36: Split")
    assert "producer" in result.output and "consumers" in result.output
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.output)


def test_a_neighbourhood_lists_nodes_by_distance(yolo) -> None:
    result = _inspect(yolo, "--node", "split_36", "--hops", "1")
    assert result.exit_code == 0, result.output
    assert "split_36 and its nodes up to 1 edge(s) away" in result.output


def test_a_search_says_how_many_nodes_it_left_out(yolo) -> None:
    result = _inspect(yolo, "--op", "Sigmoid", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert "2 of 5 node(s) (raise --limit for the rest)" in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--hops", "2"], "--hops is the neighbourhood of a --node"),
        (["--node", "split_36", "--op", "Sigmoid"], "give one of them"),
    ],
)
def test_contradicting_options_are_refused(yolo, args, words) -> None:
    result = _inspect(yolo, *args)
    assert result.exit_code == 2 and words in result.output
