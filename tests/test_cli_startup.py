"""What `surgery check` loads: every command pays for the modules imported at start-up, so the
runtime, the quantizer and ONNX Runtime load only in the commands that use them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from typer.testing import CliRunner
from server.cli import app
result = CliRunner().invoke(app, ["check", sys.argv[1], "--json"])
print(json.dumps({"exit": result.exit_code, "modules": sorted(sys.modules)}))
"""


def _relu_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _modules_after_check(model: Path) -> tuple[int, set[str]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(model)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["exit"], set(report["modules"])


def test_check_command_loads_neither_onnxruntime_nor_the_compiler_runtime(tmp_path):
    exit_code, modules = _modules_after_check(_relu_model(tmp_path / "relu.onnx"))
    assert exit_code == 0
    assert "surgery.check" in modules  # the probe did run the check
    loaded = {
        m for m in modules if m.split(".")[0] == "onnxruntime" or m.startswith("compiler.runtime")
    }
    assert not loaded, f"`surgery check` imported {sorted(loaded)[:5]}"


def _topk_model(path: Path) -> Path:
    """A Relu then a TopK: the TopK is a blocker, so check asks every rule about it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    values = helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 3, 8, 2])
    indices = helper.make_tensor_value_info("i", TensorProto.INT64, [1, 3, 8, 2])
    k = helper.make_tensor("k", TensorProto.INT64, [1], [2])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("TopK", ["r", "k"], ["v", "i"], name="topk"),
    ]
    graph = helper.make_graph(nodes, "g", [x], [values, indices], initializer=[k])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_check_with_blockers_loads_the_rules_but_not_the_split_and_edit_machinery(tmp_path):
    exit_code, modules = _modules_after_check(_topk_model(tmp_path / "topk.onnx"))
    assert exit_code == 0  # one segment, the TopK after it on the host
    assert "surgery.rules.structure" in modules  # every rule was asked
    assert not {"surgery.split", "surgery.edit"} & modules


STARTUP_PROBE = """
import atexit, gc, json, sys
gc.set_threshold(1)  # without the pause, importing would collect thousands of times
while_importing = []

def note(phase, info):
    cli = sys.modules.get("server.cli")
    if phase == "start" and cli is not None and not hasattr(cli, "main"):
        while_importing.append(info["generation"])

gc.callbacks.append(note)
atexit.register(lambda: print(json.dumps({
    "collections_while_importing": len(while_importing),
    "collecting": gc.isenabled(),
    "frozen": gc.get_freeze_count(),
})))
sys.argv = ["surgery", "targets"]
from server.startup import main
main()
"""


def _startup_state() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STARTUP_PROBE], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert "mlsoc" in out.stdout  # the command did run
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_console_script_imports_the_command_line_without_collecting():
    assert _startup_state()["collections_while_importing"] == 0


def test_the_command_runs_with_the_collector_on_and_the_imports_frozen():
    state = _startup_state()
    assert state["collecting"] is True
    assert state["frozen"] > 10_000


def test_startup_leaves_a_paused_collector_paused(monkeypatch):
    import gc

    import server.cli
    from server import startup

    seen = []
    monkeypatch.setattr(server.cli, "main", lambda: seen.append(gc.isenabled()))
    gc.disable()
    try:
        startup.main()
        assert seen == [False] and not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_every_command_declares_its_parameters_with_evaluated_annotations():
    """A postponed annotation (a string) would be compiled and evaluated by typer on every run."""
    import inspect

    from server.cli import app

    callbacks = [info.callback for info in app.registered_commands]
    postponed = [
        f"{callback.__name__}({param})"
        for callback in callbacks
        for param, spec in inspect.signature(callback).parameters.items()
        if isinstance(spec.annotation, str)
    ]
    assert len(callbacks) > 10
    assert not postponed
