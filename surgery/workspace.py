"""A folder of models with immutable, numbered versions and a history record per version.

Layout under the workspace root::

    models/<name>/v0000.onnx         the imported original (the user's file is only read)
    models/<name>/v0000.json         its history record
    models/<name>/v0001.onnx(.data)  each edit is a new version; nothing is ever overwritten
    models/<name>/v0001.json
    models/<name>/.lock              serialises writers across processes (fcntl.flock)

The record is written last, with temp file + fsync + rename, and it is what makes a version
exist: a model file without a record is the remains of an interrupted write, invisible to
readers and removed by the next writer. The latest version is simply the highest record number,
so there is no HEAD file that could disagree with the records.

Writers hold a per-model thread lock (the MCP server calls in from worker threads) and then the
on-disk lock (two processes on one workspace), so version numbers are allocated exactly once.
Readers take no lock: a record appears atomically and its model file is complete before it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from surgery.errors import WorkspaceError
from surgery.model import read_model, save_model, temp_file_beside
from surgery.text import counted

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: thread locks only
    fcntl = None  # type: ignore[assignment]

VersionRef = int | str

RECORD_FORMAT = 1
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RECORD_RE = re.compile(r"v(\d{4,})\.json")
_MODEL_FILE_RE = re.compile(r"v(\d{4,})\.onnx(\.data)?")
_VERSION_RE = re.compile(r"[vV]?(\d+)")

_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


@dataclass(frozen=True)
class VersionInfo:
    """One immutable version of a model and the record of how it was made."""

    name: str
    version: int
    path: Path
    parent: int | None
    action: str
    params: dict[str, Any] = field(default_factory=dict)
    verify: dict[str, Any] | None = None
    coverage: dict[str, Any] | None = None
    created: str = ""
    sha256: str = ""
    note: str = ""

    @property
    def id(self) -> str:
        return version_id(self.version)

    @property
    def parent_id(self) -> str | None:
        return None if self.parent is None else version_id(self.parent)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "id": self.id,
            "path": str(self.path),
            "parent": self.parent,
            "parent_id": self.parent_id,
            "action": self.action,
            "params": self.params,
            "verify": self.verify,
            "coverage": self.coverage,
            "created": self.created,
            "sha256": self.sha256,
            "note": self.note,
        }


@dataclass(frozen=True)
class DiffNode:
    """A node as the diff shows it: `key` is its name, or its signature when unnamed."""

    key: str
    op_type: str
    inputs: list[str]
    outputs: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeChange:
    """A node present in both versions whose op, wiring or attributes differ."""

    key: str
    changes: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "changes": self.changes}


@dataclass(frozen=True)
class GraphDiff:
    """Differences between two versions of one model: nodes, initializers, graph I/O."""

    name: str
    a: int
    b: int
    nodes_added: list[DiffNode] = field(default_factory=list)
    nodes_removed: list[DiffNode] = field(default_factory=list)
    nodes_changed: list[NodeChange] = field(default_factory=list)
    initializers_added: list[str] = field(default_factory=list)
    initializers_removed: list[str] = field(default_factory=list)
    initializers_changed: list[str] = field(default_factory=list)
    inputs_added: list[str] = field(default_factory=list)
    inputs_removed: list[str] = field(default_factory=list)
    inputs_changed: list[str] = field(default_factory=list)
    outputs_added: list[str] = field(default_factory=list)
    outputs_removed: list[str] = field(default_factory=list)
    outputs_changed: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not any(
            getattr(self, f)
            for f in self.__dataclass_fields__
            if f.endswith(("_added", "_removed", "_changed"))
        )

    @property
    def summary(self) -> str:
        """E.g. "+3 nodes, -1 node, 2 changed; initializers +1, -0, 0 changed"."""
        if self.identical:
            return "identical"
        parts = [
            f"+{counted(len(self.nodes_added), 'node')}, "
            f"-{counted(len(self.nodes_removed), 'node')}, {len(self.nodes_changed)} changed"
        ]
        for label in ("initializers", "inputs", "outputs"):
            added, removed, changed = (
                getattr(self, f"{label}_{kind}") for kind in ("added", "removed", "changed")
            )
            if added or removed or changed:
                parts.append(f"{label} +{len(added)}, -{len(removed)}, {len(changed)} changed")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "a": version_id(self.a),
            "b": version_id(self.b),
            "summary": self.summary,
            "identical": self.identical,
            "nodes_added": [n.to_dict() for n in self.nodes_added],
            "nodes_removed": [n.to_dict() for n in self.nodes_removed],
            "nodes_changed": [c.to_dict() for c in self.nodes_changed],
        }
        for label in ("initializers", "inputs", "outputs"):
            for kind in ("added", "removed", "changed"):
                out[f"{label}_{kind}"] = list(getattr(self, f"{label}_{kind}"))
        return out


def version_id(version: int) -> str:
    """The string form users see and type: 3 -> "v3"."""
    return f"v{version}"


def validate_name(name: str) -> str:
    """Return `name` if it is a safe model name; names become folder names, so no paths."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise WorkspaceError(
            f"invalid model name {name!r}",
            hint="use 1-64 characters: letters, digits, '.', '_' or '-', starting with a "
            "letter or digit",
        )
    return name


def sanitize_name(text: str) -> str:
    """Turn a file stem or graph name into a valid model name ("my model!" -> "my_model_")."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip("._-")[:64]
    return cleaned or "model"


def parse_version(ref: VersionRef) -> int | None:
    """Parse 3, "3", "v3" to 3 and "latest" to None; anything else is a WorkspaceError."""
    if isinstance(ref, bool):
        raise _bad_version(ref)
    if isinstance(ref, int):
        if ref < 0:
            raise _bad_version(ref)
        return ref
    if isinstance(ref, str):
        text = ref.strip()
        if text.lower() == "latest":
            return None
        match = _VERSION_RE.fullmatch(text)
        if match:
            return int(match.group(1))
    raise _bad_version(ref)


def _bad_version(ref: object) -> WorkspaceError:
    return WorkspaceError(f"invalid version {ref!r}", hint="use a number like 3, 'v3', or 'latest'")


class Workspace:
    """Models stored by name with immutable numbered versions; safe across threads and processes."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        if self.root.exists() and not self.root.is_dir():
            raise WorkspaceError(f"workspace root {self.root} is a file, not a folder")
        self.models_dir = self.root / "models"
        self._digests: dict[tuple[str, int, int], str] = {}

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    # ------------------------------------------------------------------ reading

    def list_models(self) -> list[str]:
        """Names of models with at least one complete version, sorted."""
        if not self.models_dir.is_dir():
            return []
        return sorted(
            d.name
            for d in self.models_dir.iterdir()
            if d.is_dir() and _NAME_RE.fullmatch(d.name) and self._record_numbers(d)
        )

    def versions(self, name: str) -> list[VersionInfo]:
        """Every complete version of `name`, oldest first."""
        folder = self._existing_model_dir(name)
        return [self._read_record(folder, name, n) for n in self._record_numbers(folder)]

    def history(self, name: str, version: VersionRef | None = None) -> list[VersionInfo]:
        """The log of `name`, oldest first.

        With `version`, only the lineage of that version (v0 -> … -> version, following
        parents), which differs from the full log once edits branch from older versions.
        """
        if version is None:
            return self.versions(name)
        chain = [self.info(name, version)]
        while chain[-1].parent is not None:
            chain.append(self.info(name, chain[-1].parent))
        return chain[::-1]

    def latest(self, name: str) -> VersionInfo:
        return self.info(name, "latest")

    def info(self, name: str, version: VersionRef = "latest") -> VersionInfo:
        folder = self._existing_model_dir(name)
        return self._read_record(folder, name, self._resolve(folder, name, version))

    def path(self, name: str, version: VersionRef = "latest") -> Path:
        """The .onnx file of a version (read it, never write it), checked against its record."""
        return self.checked_path(self.info(name, version))

    def load(self, name: str, version: VersionRef = "latest") -> onnx.ModelProto:
        """A fresh ModelProto of a version (with external data); editing it changes nothing."""
        return read_model(self.path(name, version))

    def checked_path(self, info: VersionInfo) -> Path:
        """`info.path`, after checking the file still has the sha256 its record gives: versions
        are immutable, so a file changed behind the workspace's back is an error, not a
        silently different model. Digests are remembered per file size and mtime."""
        path = info.path
        if not info.sha256:
            return path  # records older than digests
        try:
            stat = path.stat()
        except OSError as exc:
            raise WorkspaceError(
                f"{info.name} {info.id}: its file {path} is missing ({exc.strerror})"
            ) from None
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        digest = self._digests.get(key) or file_sha256(path)
        if digest != info.sha256:
            raise WorkspaceError(
                f"{info.name} {info.id} was modified outside the workspace: {path} no longer "
                "has the sha256 its history records",
                hint="revert to another version, or import the file again under a new name",
            )
        self._digests[key] = digest
        return path

    def diff(self, name: str, a: VersionRef, b: VersionRef = "latest") -> GraphDiff:
        """What changed from version `a` to version `b` of `name`."""
        info_a, info_b = self.info(name, a), self.info(name, b)
        return diff_models(
            read_model(self.checked_path(info_a)),
            read_model(self.checked_path(info_b)),
            name,
            info_a.version,
            info_b.version,
        )

    # ------------------------------------------------------------------ writing

    def import_model(
        self,
        source: str | os.PathLike[str] | onnx.ModelProto,
        name: str | None = None,
        *,
        note: str = "",
        read_from: str | os.PathLike[str] | None = None,
    ) -> VersionInfo:
        """Copy a model in as v0 of a new model name; a source file is only read.

        A self-contained source file is copied byte for byte, so v0 is exactly the user's file;
        a ModelProto, or a file with external data, is serialised with `save_model`.
        `read_from` is the file a ModelProto source was made from (recorded as its source).
        """
        model = read_model(source)
        is_file = not isinstance(source, onnx.ModelProto)
        if name is None:
            stem = Path(source).stem if is_file else (model.graph.name or "model")
            name = sanitize_name(stem)
        validate_name(name)
        origin = source if is_file else read_from
        params: dict[str, Any] = {"source": str(Path(origin).resolve()) if origin else None}
        copy_from = Path(source) if is_file and not _uses_external_data(Path(source)) else None
        with self._writer(name) as folder:
            existing = self._record_numbers(folder)
            if existing:
                raise WorkspaceError(
                    f"model {name!r} already exists in workspace {self.root} "
                    f"(latest is {version_id(existing[-1])})",
                    hint="pass another name to import it as a separate model",
                )
            return self._write_version(
                folder,
                name,
                0,
                model,
                copy_from=copy_from,
                parent=None,
                action="import",
                params=params,
                verify=None,
                coverage=None,
                note=note,
            )

    def add_version(
        self,
        name: str,
        model: onnx.ModelProto,
        *,
        parent: VersionRef,
        action: str,
        params: dict[str, Any] | None = None,
        verify: dict[str, Any] | None = None,
        coverage: dict[str, Any] | None = None,
        note: str = "",
    ) -> VersionInfo:
        """Store `model` as the next version of `name`, recording what made it from `parent`."""
        validate_name(name)
        if not isinstance(model, onnx.ModelProto):
            raise WorkspaceError(
                f"add_version needs an onnx.ModelProto, got {type(model).__name__}"
            )
        with self._writer(name) as folder:
            numbers = self._record_numbers(folder)
            if not numbers:
                raise self._unknown_model(name)
            parent_no = self._resolve(folder, name, parent)
            return self._write_version(
                folder,
                name,
                numbers[-1] + 1,
                model,
                copy_from=None,
                parent=parent_no,
                action=action,
                params=params or {},
                verify=verify,
                coverage=coverage,
                note=note,
            )

    def revert(self, name: str, version: VersionRef, *, note: str = "") -> VersionInfo:
        """A new version byte-identical to `version`; undo without rewriting history.

        The .onnx file is copied as is; if it uses external data it keeps pointing at the
        target version's data file, which is safe because versions are immutable.
        """
        validate_name(name)
        with self._writer(name) as folder:
            numbers = self._record_numbers(folder)
            if not numbers:
                raise self._unknown_model(name)
            target = self._read_record(folder, name, self._resolve(folder, name, version))
            return self._write_version(
                folder,
                name,
                numbers[-1] + 1,
                None,
                copy_from=self.checked_path(target),
                parent=numbers[-1],
                action="revert",
                params={"to": target.id},
                verify=None,
                coverage=target.coverage,
                note=note,
            )

    # ------------------------------------------------------------------ internals

    def _model_dir(self, name: str) -> Path:
        return self.models_dir / validate_name(name)

    def _existing_model_dir(self, name: str) -> Path:
        folder = self._model_dir(name)
        if not self._record_numbers(folder):
            raise self._unknown_model(name)
        return folder

    def _unknown_model(self, name: str) -> WorkspaceError:
        known = self.list_models()
        return WorkspaceError(
            f"no model {name!r} in workspace {self.root}",
            hint=f"models: {', '.join(known)}" if known else "import one first",
        )

    @staticmethod
    def _record_numbers(folder: Path) -> list[int]:
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m.group(1)) for f in names if (m := _RECORD_RE.fullmatch(f)))

    def _resolve(self, folder: Path, name: str, ref: VersionRef) -> int:
        wanted = parse_version(ref)
        numbers = self._record_numbers(folder)
        if not numbers:
            raise self._unknown_model(name)
        if wanted is None:
            return numbers[-1]
        if wanted not in numbers:
            raise WorkspaceError(
                f"model {name!r} has no version {version_id(wanted)}; "
                f"latest is {version_id(numbers[-1])}"
            )
        return wanted

    def _read_record(self, folder: Path, name: str, number: int) -> VersionInfo:
        path = folder / _record_name(number)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return VersionInfo(
                name=name,
                version=number,
                path=folder / data["file"],
                parent=data["parent"],
                action=data["action"],
                params=data.get("params") or {},
                verify=data.get("verify"),
                coverage=data.get("coverage"),
                created=data.get("created", ""),
                sha256=data.get("sha256", ""),
                note=data.get("note", ""),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WorkspaceError(f"history record {path} is unreadable: {exc}") from None

    @contextlib.contextmanager
    def _writer(self, name: str) -> Iterator[Path]:
        """Hold the model's thread lock and on-disk lock; yield its folder, cleaned of debris."""
        folder = self._model_dir(name)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise WorkspaceError(f"cannot create {folder}: a file is in the way ({exc})") from None
        except OSError as exc:
            raise WorkspaceError(f"cannot create {folder}: {exc.strerror or exc}") from None
        with _thread_lock(folder), _file_lock(folder / ".lock"):
            _remove_debris(folder, self._record_numbers(folder))
            yield folder

    def _write_version(
        self,
        folder: Path,
        name: str,
        number: int,
        model: onnx.ModelProto | None,
        *,
        copy_from: Path | None,
        parent: int | None,
        action: str,
        params: dict[str, Any],
        verify: dict[str, Any] | None,
        coverage: dict[str, Any] | None,
        note: str,
    ) -> VersionInfo:
        """Write model file(s), then the record; on any failure leave no trace of `number`."""
        model_path = folder / _model_name(number)
        record: dict[str, Any] = {
            "format": RECORD_FORMAT,
            "name": name,
            "version": number,
            "file": model_path.name,
            "parent": parent,
            "action": action,
            "params": params,
            "verify": verify,
            "coverage": coverage,
            "created": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "sha256": "",
            "note": note,
        }
        _to_json(record, what=f"the record for {name!r}")  # fail before touching the disk
        try:
            if copy_from is not None:
                _copy_atomic(copy_from, model_path)
            else:
                assert model is not None
                save_model(model, model_path)
            record["sha256"] = file_sha256(model_path)
            _write_atomic(folder / _record_name(number), _to_json(record))
        except BaseException as exc:
            _remove_version_files(folder, number)
            if isinstance(exc, OSError):
                raise WorkspaceError(
                    f"cannot write {version_id(number)} of {name!r} in {folder}: "
                    f"{exc.strerror or exc}"
                ) from exc
            raise
        return self._read_record(folder, name, number)


def diff_models(
    model_a: onnx.ModelProto, model_b: onnx.ModelProto, name: str = "", a: int = 0, b: int = 0
) -> GraphDiff:
    """Compare two models' top-level graphs.

    Nodes are matched by name when the name is present and unique in its graph, otherwise by
    (domain, op_type, inputs, outputs); a matched pair whose op, wiring or attributes differ is
    "changed". Initializers match by name and compare dims, dtype and a digest of the values.
    """
    nodes_a, nodes_b = _keyed_nodes(model_a.graph), _keyed_nodes(model_b.graph)
    added = [_diff_node(k, nodes_b[k]) for k in nodes_b if k not in nodes_a]
    removed = [_diff_node(k, nodes_a[k]) for k in nodes_a if k not in nodes_b]
    changed = []
    for key, node_a in nodes_a.items():
        node_b = nodes_b.get(key)
        if node_b is not None:
            changes = _node_changes(node_a, node_b)
            if changes:
                changed.append(NodeChange(key, changes))
    inits_a, inits_b = _initializer_digests(model_a.graph), _initializer_digests(model_b.graph)
    io = {}
    for label in ("input", "output"):
        io[label] = _compare(*(_value_infos(m.graph, label) for m in (model_a, model_b)))
    return GraphDiff(
        name=name,
        a=a,
        b=b,
        nodes_added=added,
        nodes_removed=removed,
        nodes_changed=changed,
        initializers_added=_new_keys(inits_a, inits_b),
        initializers_removed=_new_keys(inits_b, inits_a),
        initializers_changed=[k for k in inits_a if k in inits_b and inits_a[k] != inits_b[k]],
        inputs_added=io["input"][0],
        inputs_removed=io["input"][1],
        inputs_changed=io["input"][2],
        outputs_added=io["output"][0],
        outputs_removed=io["output"][1],
        outputs_changed=io["output"][2],
    )


def _new_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [k for k in new if k not in old]


def _compare(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    changed = [k for k in old if k in new and old[k] != new[k]]
    return _new_keys(old, new), _new_keys(new, old), changed


def _keyed_nodes(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.name:
            counts[node.name] = counts.get(node.name, 0) + 1
    keyed: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        if node.name and counts[node.name] == 1:
            key = node.name
        else:
            domain = f"{node.domain}." if node.domain else ""
            key = f"{domain}{node.op_type}({', '.join(node.input)}) -> ({', '.join(node.output)})"
        base, i = key, 1
        while key in keyed:  # identical signatures (e.g. nodes without outputs) stay distinct
            i += 1
            key = f"{base} #{i}"
        keyed[key] = node
    return keyed


def _diff_node(key: str, node: onnx.NodeProto) -> DiffNode:
    return DiffNode(key, node.op_type, list(node.input), list(node.output))


def _node_changes(a: onnx.NodeProto, b: onnx.NodeProto) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for fld in ("op_type", "domain"):
        if getattr(a, fld) != getattr(b, fld):
            changes[fld] = [getattr(a, fld), getattr(b, fld)]
    for fld in ("input", "output"):
        if list(getattr(a, fld)) != list(getattr(b, fld)):
            changes[f"{fld}s"] = [list(getattr(a, fld)), list(getattr(b, fld))]
    attrs_a, attrs_b = _attributes(a), _attributes(b)
    differing = sorted(
        k for k in attrs_a.keys() | attrs_b.keys() if attrs_a.get(k) != attrs_b.get(k)
    )
    if differing:
        changes["attributes"] = differing
    return changes


def _attributes(node: onnx.NodeProto) -> dict[str, bytes]:
    return {a.name: a.SerializeToString(deterministic=True) for a in node.attribute}


def _initializer_digests(graph: onnx.GraphProto) -> dict[str, tuple[Any, ...]]:
    """name -> (dims, dtype, digest of the values); raw_data vs typed fields compare equal."""
    out: dict[str, tuple[Any, ...]] = {}
    for t in graph.initializer:
        try:
            digest = hashlib.sha256(np.ascontiguousarray(numpy_helper.to_array(t)).tobytes())
        except Exception:  # unusual dtypes: fall back to the proto itself
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.ClearField("name")
            digest = hashlib.sha256(copy.SerializeToString(deterministic=True))
        out[t.name] = (tuple(t.dims), t.data_type, digest.hexdigest())
    return out


def _value_infos(graph: onnx.GraphProto, label: str) -> dict[str, bytes]:
    """Graph inputs (initializers listed as inputs excluded) or outputs: name -> type."""
    inits = {t.name for t in graph.initializer} if label == "input" else set()
    return {
        v.name: v.type.SerializeToString(deterministic=True)
        for v in getattr(graph, label)
        if v.name not in inits
    }


def _model_name(number: int) -> str:
    return f"v{number:04d}.onnx"


def _record_name(number: int) -> str:
    return f"v{number:04d}.json"


@contextlib.contextmanager
def _thread_lock(folder: Path) -> Iterator[None]:
    key = (str(folder.resolve().parent), folder.name)
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        yield


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive flock on `path` while writing; released when the descriptor closes."""
    try:
        f = open(path, "a+b")  # noqa: SIM115 - held open for the duration of the lock
    except OSError as exc:
        raise WorkspaceError(f"cannot open lock file {path}: {exc.strerror or exc}") from None
    try:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        f.close()


def _remove_debris(folder: Path, numbers: list[int]) -> None:
    """Delete temp files and model files of versions that never got a record.

    Only called under the writer locks, so no write is in progress and anything here that
    no record vouches for is left over from an interrupted one.
    """
    latest = numbers[-1] if numbers else -1
    for entry in os.listdir(folder):
        match = _MODEL_FILE_RE.fullmatch(entry)
        stale = (entry.startswith(".") and entry.endswith(".tmp")) or (
            match is not None and int(match.group(1)) > latest
        )
        if stale:
            with contextlib.suppress(FileNotFoundError):
                (folder / entry).unlink()


def _remove_version_files(folder: Path, number: int) -> None:
    for entry in (_record_name(number), _model_name(number), f"{_model_name(number)}.data"):
        with contextlib.suppress(FileNotFoundError):
            (folder / entry).unlink()


def _to_json(record: dict[str, Any], *, what: str = "the record") -> bytes:
    try:
        return json.dumps(record, indent=2, default=_json_default, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise WorkspaceError(f"cannot store {what}: {exc}") from None


def _json_default(obj: Any) -> Any:
    """numpy scalars/arrays, paths, sets and dataclasses from verify/coverage results."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, rename: readers see the old state or the new one."""
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _copy_atomic(src: Path, dst: Path) -> None:
    fd, tmp = temp_file_beside(dst)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (models can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _uses_external_data(path: Path) -> bool:
    """Whether a file's tensors live in side files (then a byte copy would dangle)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # read_model accepted the file; when in doubt, re-serialise it
        return True
    return any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.external_data_helper._get_all_tensors(model)
    )


__all__ = [
    "DiffNode",
    "GraphDiff",
    "NodeChange",
    "VersionInfo",
    "VersionRef",
    "Workspace",
    "WorkspaceError",
    "diff_models",
    "parse_version",
    "sanitize_name",
    "validate_name",
]
