"""What every tool shares: the workspace, the path policy and a small cache of loaded versions.

Tools run on worker threads, so everything here is either immutable (the policy), already
thread-safe (the Workspace locks per model) or guarded by a lock (the cache). Versions are
immutable, so a cached version can never be stale: the key includes the file's sha256.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from server.paths import PathPolicy
from surgery.model import load_model
from surgery.workspace import VersionInfo, VersionRef, Workspace

DEFAULT_TARGET = "mlsoc"


class ModelCache:
    """Shape-inferred ModelProtos of recent versions, shared by the read-only tools.

    Callers must treat the protos as read-only: editing tools load their own copy.
    """

    def __init__(self, size: int = 6) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, int, str], onnx.ModelProto] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, info: VersionInfo) -> onnx.ModelProto:
        key = (info.name, info.version, info.sha256)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        model = load_model(info.path)  # outside the lock: loads may run in parallel
        with self._lock:
            self._items[key] = model
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return model


@dataclass
class ServerState:
    workspace: Workspace
    policy: PathPolicy
    default_target: str = DEFAULT_TARGET
    cache: ModelCache = field(default_factory=ModelCache)
    import_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises open_model's check-then-import (the Workspace locks each write, not the pair)."""

    @classmethod
    def create(
        cls,
        workspace: str | os.PathLike[str],
        allow_roots: Sequence[str | os.PathLike[str]],
        default_target: str = DEFAULT_TARGET,
    ) -> ServerState:
        ws = Workspace(workspace)
        return cls(ws, PathPolicy(allow_roots, protected=[ws.root]), default_target)

    def info(self, name: str, version: VersionRef = "latest") -> VersionInfo:
        return self.workspace.info(name, version)

    def read_only(
        self, name: str, version: VersionRef = "latest"
    ) -> tuple[VersionInfo, onnx.ModelProto]:
        """A version and its shared, shape-inferred proto (do not modify it)."""
        info = self.info(name, version)
        self.workspace.checked_path(info)
        return info, self.cache.get(info)

    def editable(
        self, name: str, version: VersionRef = "latest"
    ) -> tuple[VersionInfo, onnx.ModelProto]:
        """A version and a fresh, shape-inferred proto the caller owns."""
        info = self.info(name, version)
        return info, load_model(self.workspace.checked_path(info))

    def input_path(self, raw: str) -> Path:
        return self.policy.resolve(raw)

    def output_path(self, raw: str) -> Path:
        """A confined path to write, with its folder created (an agent may have no shell)."""
        dest = self.policy.resolve(raw, write=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest
