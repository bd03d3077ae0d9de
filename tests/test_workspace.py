"""The versioned workspace: immutable versions, history, diff, revert, atomicity, locking."""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import surgery.workspace as ws_module
from surgery.errors import WorkspaceError
from surgery.session import import_or_reuse
from surgery.workspace import GraphDiff, VersionInfo, Workspace, diff_models, parse_version


def _model(
    nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto] | None = None
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])],
        initializer=inits or [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _bias(value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full([1, 4], value, dtype=np.float32), "B")


@pytest.fixture
def relu_model() -> onnx.ModelProto:
    """X -> Relu -> Y."""
    return _model([helper.make_node("Relu", ["X"], ["Y"], name="relu")])


@pytest.fixture
def bigger_model() -> onnx.ModelProto:
    """X -> Relu -> Add(B) -> Y: one node and one initializer more than `relu_model`."""
    return _model(
        [
            helper.make_node("Relu", ["X"], ["R"], name="relu"),
            helper.make_node("Add", ["R", "B"], ["Y"], name="add"),
        ],
        [_bias(1.0)],
    )


@pytest.fixture
def source(tmp_path: Path, relu_model: onnx.ModelProto) -> Path:
    path = tmp_path / "src" / "my model.onnx"
    path.parent.mkdir()
    onnx.save(relu_model, str(path))
    return path


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_import_creates_v0_and_leaves_source_untouched(ws: Workspace, source: Path) -> None:
    before = (_sha(source), source.stat().st_mtime_ns)

    info = ws.import_model(source, "net", note="original")

    assert (info.version, info.id, info.parent, info.action) == (0, "v0", None, "import")
    assert (_sha(source), source.stat().st_mtime_ns) == before
    assert info.sha256 == before[0]  # v0 is a byte copy of the user's file
    assert info.path == ws.root / "models" / "net" / "v0000.onnx"
    assert ws.list_models() == ["net"]


def test_import_default_name_is_sanitised_file_stem(ws: Workspace, source: Path) -> None:
    assert ws.import_model(source).name == "my_model"


def test_import_of_model_proto_uses_graph_name(ws: Workspace, relu_model: onnx.ModelProto) -> None:
    info = ws.import_model(relu_model)
    assert info.name == "g"
    assert ws.load("g").graph.node[0].op_type == "Relu"


def test_import_existing_name_raises_with_hint(ws: Workspace, source: Path) -> None:
    ws.import_model(source, "net")
    with pytest.raises(WorkspaceError, match="already exists") as err:
        ws.import_model(source, "net")
    assert "another name" in str(err.value)


def test_add_version_numbers_and_parent_chain(
    ws: Workspace, source: Path, bigger_model: onnx.ModelProto, relu_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    v1 = ws.add_version("net", bigger_model, parent=0, action="rule:add_bias", params={"k": 1})
    v2 = ws.add_version("net", relu_model, parent="v1", action="rule:drop", verify={"ok": True})

    history = ws.history("net")
    assert [v.version for v in history] == [0, 1, 2]
    assert [v.parent for v in history] == [None, 0, 1]
    assert (v1.action, v1.params, v2.verify) == ("rule:add_bias", {"k": 1}, {"ok": True})
    assert ws.latest("net") == v2
    assert all(v.created.endswith("+00:00") for v in history)


def test_history_with_version_follows_parents_only(
    ws: Workspace, source: Path, relu_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    ws.add_version("net", relu_model, parent=0, action="a")
    ws.add_version("net", relu_model, parent=0, action="b")  # branches from v0, not v1
    assert [v.id for v in ws.history("net", "latest")] == ["v0", "v2"]


def test_load_round_trips_the_stored_model(
    ws: Workspace, source: Path, bigger_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    ws.add_version("net", bigger_model, parent=0, action="edit")
    loaded = ws.load("net", "latest")
    assert loaded.SerializeToString() == bigger_model.SerializeToString()
    assert ws.load("net", 0).graph.node[0].op_type == "Relu"


def test_a_version_changed_behind_the_workspace_is_refused(ws: Workspace, source: Path) -> None:
    info = ws.import_model(source, "m")
    ws.load("m", 0)
    info.path.write_bytes(info.path.read_bytes() + b"\x00")  # a byte appended outside
    with pytest.raises(WorkspaceError, match="modified outside the workspace"):
        ws.load("m", 0)
    with pytest.raises(WorkspaceError, match="modified outside the workspace"):
        ws.revert("m", 0)


def test_version_refs_accept_int_string_and_prefixed_forms() -> None:
    assert [parse_version(r) for r in (3, "3", "v3", "V3", " latest ")] == [3, 3, 3, 3, None]


@pytest.mark.parametrize("bad", ["", "v", "3.0", "-1", -1, "head", True, None])
def test_bad_version_refs_raise_workspace_error(bad: object) -> None:
    with pytest.raises(WorkspaceError, match="invalid version"):
        parse_version(bad)  # type: ignore[arg-type]


def test_missing_version_names_the_latest(ws: Workspace, source: Path) -> None:
    ws.import_model(source, "yolo")
    with pytest.raises(WorkspaceError, match=r"model 'yolo' has no version v7; latest is v0"):
        ws.load("yolo", "v7")


def test_unknown_model_lists_known_models(ws: Workspace, source: Path) -> None:
    ws.import_model(source, "net")
    with pytest.raises(WorkspaceError, match="no model 'other'") as err:
        ws.history("other")
    assert "models: net" in str(err.value)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "-x", "a" * 65, "a b"])
def test_invalid_model_names_raise_workspace_error(ws: Workspace, source: Path, bad: str) -> None:
    with pytest.raises(WorkspaceError, match="invalid model name"):
        ws.import_model(source, bad)
    assert not (ws.root / "x").exists()


def test_root_that_is_a_file_raises_workspace_error(tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with pytest.raises(WorkspaceError, match="is a file"):
        Workspace(file)


def test_diff_reports_added_removed_and_changed_nodes(ws: Workspace, source: Path) -> None:
    ws.import_model(
        _model(
            [
                helper.make_node("Relu", ["X"], ["R"], name="relu"),
                helper.make_node("LeakyRelu", ["R"], ["L"], name="leaky", alpha=0.1),
                helper.make_node("Sigmoid", ["L"], ["Y"], name="sig"),
            ]
        ),
        "net",
    )
    ws.add_version(
        "net",
        _model(
            [
                helper.make_node("Relu", ["X"], ["R"], name="relu"),
                helper.make_node("LeakyRelu", ["R"], ["L"], name="leaky", alpha=0.2),
                helper.make_node("Tanh", ["L"], ["T"], name="tanh"),
                helper.make_node("Neg", ["T"], ["Y"]),
            ]
        ),
        parent=0,
        action="edit",
    )

    diff = ws.diff("net", 0, "latest")

    assert isinstance(diff, GraphDiff)
    assert [n.key for n in diff.nodes_added] == ["tanh", "Neg(T) -> (Y)"]
    assert [n.key for n in diff.nodes_removed] == ["sig"]
    assert [(c.key, c.changes) for c in diff.nodes_changed] == [
        ("leaky", {"attributes": ["alpha"]})
    ]
    assert diff.summary == "+2 nodes, -1 node, 1 changed"
    json.dumps(diff.to_dict())


def test_diff_reports_initializer_and_io_changes(
    ws: Workspace, source: Path, bigger_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    ws.add_version("net", bigger_model, parent=0, action="edit")
    changed = onnx.ModelProto()
    changed.CopyFrom(bigger_model)
    changed.graph.initializer[0].CopyFrom(_bias(2.0))
    changed.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    ws.add_version("net", changed, parent=1, action="edit")

    assert ws.diff("net", 0, 1).initializers_added == ["B"]
    diff = ws.diff("net", 1, 2)
    assert (diff.initializers_changed, diff.outputs_changed) == (["B"], ["Y"])
    assert diff.summary.startswith("+0 nodes, -0 nodes, 0 changed; initializers +0, -0, 1 changed")


def test_diff_of_a_version_with_itself_is_identical(ws: Workspace, source: Path) -> None:
    ws.import_model(source, "net")
    assert ws.diff("net", 0, 0).summary == "identical"


def test_revert_creates_new_version_identical_to_target(
    ws: Workspace, source: Path, bigger_model: onnx.ModelProto
) -> None:
    v0 = ws.import_model(source, "net")
    ws.add_version("net", bigger_model, parent=0, action="edit", coverage={"segments": 1})

    reverted = ws.revert("net", "v0")

    assert (reverted.version, reverted.parent, reverted.action) == (2, 1, "revert")
    assert reverted.params == {"to": "v0"}
    assert reverted.sha256 == v0.sha256 == _sha(reverted.path)
    assert ws.diff("net", 0, 2).identical


def test_failed_model_write_leaves_no_version_and_next_write_numbers_correctly(
    ws: Workspace, source: Path, relu_model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws.import_model(source, "net")

    def half_write(model: onnx.ModelProto, path: Path) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ws_module, "save_model", half_write)
    with pytest.raises(WorkspaceError, match="cannot write v1 of 'net'.*No space left"):
        ws.add_version("net", relu_model, parent=0, action="edit")
    monkeypatch.undo()

    assert [v.version for v in ws.versions("net")] == [0]
    assert not (ws.root / "models" / "net" / "v0001.onnx").exists()
    assert ws.add_version("net", relu_model, parent=0, action="edit").version == 1


def test_failed_record_write_leaves_no_version(
    ws: Workspace, source: Path, relu_model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws.import_model(source, "net")

    def fail(path: Path, data: bytes) -> None:
        raise RuntimeError("crash while writing the record")

    monkeypatch.setattr(ws_module, "_write_atomic", fail)
    with pytest.raises(RuntimeError):
        ws.add_version("net", relu_model, parent=0, action="edit")
    monkeypatch.undo()

    assert ws.latest("net").version == 0
    assert sorted(p.name for p in (ws.root / "models" / "net").glob("v*")) == [
        "v0000.json",
        "v0000.onnx",
    ]


def test_model_file_without_record_is_ignored_and_cleaned_up(
    ws: Workspace, source: Path, relu_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    folder = ws.root / "models" / "net"
    (folder / "v0001.onnx").write_bytes(b"interrupted")
    (folder / ".v0001.onnx.abc.tmp").write_bytes(b"interrupted")

    assert ws.latest("net").version == 0
    info = ws.add_version("net", relu_model, parent=0, action="edit")

    assert info.version == 1
    assert ws.load("net", 1).graph.node[0].op_type == "Relu"
    assert not list(folder.glob(".*.tmp"))


def test_unserialisable_params_fail_before_writing(
    ws: Workspace, source: Path, relu_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    with pytest.raises(WorkspaceError, match="cannot store"):
        ws.add_version("net", relu_model, parent=0, action="edit", params={"x": object()})
    assert ws.latest("net").version == 0


def test_numpy_values_in_verify_results_are_stored_as_json(
    ws: Workspace, source: Path, relu_model: onnx.ModelProto
) -> None:
    ws.import_model(source, "net")
    verify = {"max_abs": np.float32(0.5), "shape": np.array([1, 4])}
    info = ws.add_version("net", relu_model, parent=0, action="edit", verify=verify)
    assert info.verify == {"max_abs": 0.5, "shape": [1, 4]}
    json.dumps(info.to_dict())


def test_concurrent_add_version_allocates_distinct_consecutive_numbers(
    tmp_path: Path, source: Path, relu_model: onnx.ModelProto
) -> None:
    Workspace(tmp_path / "ws").import_model(source, "net")
    results: list[VersionInfo] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        # A Workspace per thread too: the locks belong to the folder, not the object.
        workspace = Workspace(tmp_path / "ws")
        barrier.wait()
        try:
            results.append(workspace.add_version("net", relu_model, parent=0, action=f"t{i}"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not errors
    assert sorted(r.version for r in results) == list(range(1, 9))
    assert [v.version for v in Workspace(tmp_path / "ws").versions("net")] == list(range(9))


def _add_versions_in_child(root: str, model_bytes: bytes, count: int) -> None:
    model = onnx.load_from_string(model_bytes)
    for _ in range(count):
        Workspace(root).add_version("net", model, parent=0, action="child")


def test_two_processes_never_allocate_the_same_version(
    tmp_path: Path, source: Path, relu_model: onnx.ModelProto
) -> None:
    root = str(tmp_path / "ws")
    Workspace(root).import_model(source, "net")
    ctx = multiprocessing.get_context("fork")
    args = (root, relu_model.SerializeToString(), 4)
    procs = [ctx.Process(target=_add_versions_in_child, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)

    assert [p.exitcode for p in procs] == [0, 0]
    assert [v.version for v in Workspace(root).versions("net")] == list(range(9))


@pytest.fixture
def heavy_model(bigger_model: onnx.ModelProto) -> onnx.ModelProto:
    """`bigger_model` plus a 4 KiB table: large enough to go to an external data file."""
    table = np.arange(1024, dtype=np.float32)
    bigger_model.graph.initializer.append(numpy_helper.from_array(table, "table"))
    return bigger_model


def test_import_of_source_with_external_data_loads_back(
    ws: Workspace, tmp_path: Path, heavy_model: onnx.ModelProto
) -> None:
    src = tmp_path / "ext" / "heavy.onnx"
    src.parent.mkdir()
    copy = onnx.ModelProto()
    copy.CopyFrom(heavy_model)  # onnx.save moves the weights out of the proto it is given
    onnx.save(copy, str(src), save_as_external_data=True, location="heavy.onnx.data")
    before = (_sha(src), _sha(src.parent / "heavy.onnx.data"))

    ws.import_model(src)

    assert (_sha(src), _sha(src.parent / "heavy.onnx.data")) == before
    assert diff_models(ws.load("heavy"), heavy_model).identical


def test_revert_of_external_data_version_shares_the_immutable_data_file(
    ws: Workspace, source: Path, heavy_model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws.import_model(source, "net")
    monkeypatch.setattr(
        ws_module, "save_model", functools.partial(ws_module.save_model, external_data=True)
    )
    v1 = ws.add_version("net", heavy_model, parent=0, action="edit")
    assert (ws.root / "models" / "net" / "v0001.onnx.data").exists()

    reverted = ws.revert("net", 1)

    assert reverted.sha256 == v1.sha256
    assert diff_models(ws.load("net", reverted.version), heavy_model).identical


def test_reimporting_an_unchanged_file_reuses_its_version(ws: Workspace, source: Path) -> None:
    first = import_or_reuse(ws, source)
    again = import_or_reuse(ws, source)
    assert (again.name, again.version) == (first.name, first.version)
    assert len(ws.versions(first.name)) == 1


def test_reimporting_an_edited_file_adds_a_version(
    ws: Workspace, source: Path, bigger_model: onnx.ModelProto
) -> None:
    first = import_or_reuse(ws, source)
    onnx.save(bigger_model, source)
    again = import_or_reuse(ws, source)
    assert (again.version, again.parent) == (1, first.version)


def test_another_file_with_the_same_stem_is_refused(ws: Workspace, source: Path, tmp_path) -> None:
    import_or_reuse(ws, source)
    other = tmp_path / "elsewhere" / source.name
    other.parent.mkdir()
    other.write_bytes(source.read_bytes())
    with pytest.raises(WorkspaceError, match="another file"):
        import_or_reuse(ws, other)
