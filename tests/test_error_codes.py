"""A missing file is `file_not_found` in every command's --json error, whatever the command
(check, verify, run, archive): an agent branches on one code."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from server.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args",
    [
        ["check", "{missing}.onnx"],
        ["verify", "{missing}.onnx", "{missing}.onnx"],
        ["run", "{missing}_mpk.tar.gz"],
        ["archive", "{missing}_mpk.tar.gz"],
    ],
)
def test_a_missing_file_has_one_error_code_everywhere(args, tmp_path):
    argv = [a.format(missing=tmp_path / "absent") for a in args]
    result = runner.invoke(app, [*argv, "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["code"] == "file_not_found"
