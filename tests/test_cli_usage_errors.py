"""With --json, a usage error (a missing option, an unknown one, a value refused while
parsing) is a JSON error document on stdout like every other error, with exit code 2: an
agent reads stdout, where it found nothing. The command's exit codes stay as they were."""

from __future__ import annotations

import json

import pytest

from server.cli import main
from surgery import examples
from surgery.model import save_model


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr("sys.argv", ["surgery", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["quantize", "model.onnx", "--json"], "Missing option '--calib'."),
        (["check", "model.onnx", "--json", "--frobnicate"], "No such option: --frobnicate"),
        (["demo", "--example", "zz", "--json"], "unknown example 'zz'"),
    ],
)
def test_a_usage_error_with_json_is_a_json_error_on_stdout(monkeypatch, capsys, args, message):
    code, out = _main(monkeypatch, capsys, *args)
    assert code == 2
    error = json.loads(out)["error"]
    assert error["code"] == "usage_error" and message in error["message"]
    assert error["hint"] == f"surgery {args[0]} --help lists the options"


def test_a_command_run_with_json_keeps_its_exit_code(monkeypatch, capsys, tmp_path):
    path = save_model(examples.cnn_with_topk(), tmp_path / "topk.onnx")
    code, out = _main(monkeypatch, capsys, "check", str(path), "--json")
    assert code == 1 and json.loads(out)["mla_segments"] == 2
    path = save_model(examples.plain_cnn(), tmp_path / "cnn.onnx")
    code, out = _main(monkeypatch, capsys, "check", str(path), "--json")
    assert code == 0 and json.loads(out)["single_elf"] is True
