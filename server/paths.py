"""Path confinement: every file a tool reads or writes must lie under an allowed root.

An MCP client is driven by a model that may be steered by text it has read, so a tool that takes
a path is an open door unless the server, not the client, decides which folders it may touch.
Paths are resolved (symlinks included) before the check, so `..`, absolute paths elsewhere and
symlinks that point out of a root are all refused with the same clear error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from surgery.errors import SurgeryError

MODEL_SUFFIX = ".onnx"


class PathNotAllowedError(SurgeryError):
    """A path outside the allowed roots, or one a tool must not write."""

    code = "path_not_allowed"


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


class PathPolicy:
    """The allowed roots (and the folders inside them a tool may never write)."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]], *, protected: Sequence[Path] = ()):
        if not roots:
            raise PathNotAllowedError("at least one allowed root is required")
        resolved = []
        for root in roots:
            real = _real(Path(root).expanduser().absolute())
            if not real.is_dir():
                raise PathNotAllowedError(f"allowed root {root} is not an existing folder")
            resolved.append(real)
        self.roots: tuple[Path, ...] = tuple(dict.fromkeys(resolved))
        self.protected: tuple[Path, ...] = tuple(_real(p.absolute()) for p in protected)

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.roots)

    def resolve(self, raw: str, *, write: bool = False) -> Path:
        """The real path of `raw`, or PathNotAllowedError saying why it is refused.

        Relative paths are taken from the first root. With `write`, the path must also end in
        `.onnx` and must not lie in a protected folder (the workspace: versions are immutable);
        missing folders on the way are allowed (`ServerState.output_path` creates them).
        """
        if not isinstance(raw, str) or not raw.strip():
            raise PathNotAllowedError("empty path")
        if "\x00" in raw:
            raise PathNotAllowedError("path contains a NUL byte")
        candidate = Path(raw)
        if ".." in candidate.parts:
            raise PathNotAllowedError(
                f"path {raw!r} contains '..'; parent-folder references are not accepted",
                hint=f"give a path under the allowed roots: {self.describe()}",
            )
        if not candidate.is_absolute():
            candidate = self.roots[0] / candidate
        real = _real(candidate)
        root = next((r for r in self.roots if real == r or real.is_relative_to(r)), None)
        if root is None:
            via = " (through a symbolic link)" if _lexically_inside(candidate, self.roots) else ""
            raise PathNotAllowedError(
                f"path {raw!r} resolves to {real}{via}, which is outside the allowed roots",
                hint=f"allowed roots: {self.describe()}; start the server with --allow-root DIR "
                "to allow another folder",
            )
        if write:
            self._check_writable(raw, real)
        return real

    def _check_writable(self, raw: str, real: Path) -> None:
        if real.suffix != MODEL_SUFFIX:
            raise PathNotAllowedError(
                f"refusing to write {raw!r}: only {MODEL_SUFFIX} files are written",
                hint="choose a file name ending in .onnx",
            )
        for folder in self.protected:
            if real == folder or real.is_relative_to(folder):
                raise PathNotAllowedError(
                    f"refusing to write {raw!r}: it is inside the workspace {folder}, whose "
                    "versions are immutable",
                    hint="export to a path outside the workspace folder",
                )
        blocking = file_in_the_way(real)
        if blocking is not None:
            raise PathNotAllowedError(f"cannot write {raw!r}: {blocking} is a file, not a folder")
        if real.is_dir():
            raise PathNotAllowedError(f"cannot write {raw!r}: it is a folder")


def _lexically_inside(path: Path, roots: Sequence[Path]) -> bool:
    """Whether the path, before resolving symlinks, lies in a root (to explain a refusal)."""
    normal = Path(os.path.normpath(path.absolute()))
    return any(normal == r or normal.is_relative_to(r) for r in roots)


def file_in_the_way(path: Path) -> Path | None:
    """The first existing ancestor of `path` that is not a folder (the folders a write would
    create cannot be made under it), or None."""
    return next((p for p in path.parents if p.exists() and not p.is_dir()), None)
