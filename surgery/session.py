"""Rewrites recorded in a workspace: the glue the CLI and the MCP server share.

A model enters the workspace once (v0 = the user's file, untouched at its source); each
applied rule or fix step becomes a new version whose history record carries the rule, its
parameters, the verification metrics and the coverage summary.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from surgery.coverage import CoverageReport
from surgery.errors import WorkspaceError
from surgery.model import load_model
from surgery.rules.engine import RewriteResult
from surgery.rules.fix import FixResult
from surgery.workspace import VersionInfo, Workspace, file_sha256, sanitize_name


def coverage_summary(cov: CoverageReport) -> dict[str, Any]:
    return {
        "target": cov.target,
        "mla_segments": cov.mla_segments,
        "single_elf": cov.single_elf,
        "blockers": len(cov.blockers),
        "mla_mac_fraction": round(cov.mla_mac_fraction, 6),
    }


def name_in_workspace(ws: Workspace, source: str | os.PathLike, name: str | None = None) -> str:
    """The name `source`'s versions go under (`name`, else its file name), refused at once
    when that name holds another file's versions: a command checks it before its work, which
    would otherwise be done (and its output written) for nothing."""
    chosen = sanitize_name(name or Path(source).stem)
    if chosen in ws.list_models():
        refuse_other_source(ws, chosen, source)
    return chosen


def import_or_reuse(
    ws: Workspace, source: str | os.PathLike, name: str | None = None
) -> VersionInfo:
    """Import the file as a model; if that name holds this file already, the version it was
    imported as (unchanged) or a new version (the file was edited outside)."""
    path = Path(source)
    return _import_or_reuse(ws, path, name or sanitize_name(path.stem))[0]


def _import_or_reuse(
    ws: Workspace, path: Path, name: str, digest: str | None = None
) -> tuple[VersionInfo, bool]:
    """`import_or_reuse`, and whether it stored a version. `digest` is the file's sha256 when
    the caller has it (it is only needed when the name exists)."""
    if name not in ws.list_models():
        return ws.import_model(path, name), True
    versions = ws.versions(name)
    refuse_other_source(ws, name, path, versions)
    digest = digest or file_sha256(path)
    same = [v for v in versions if v.action == "import" and v.sha256 == digest]
    if same:  # the file is unchanged since that import: every rewrite starts from it
        return same[-1], False
    from surgery.model import read_model

    info = ws.add_version(
        name,
        read_model(path),
        parent=versions[-1].version,
        action="import",
        params={"source": str(path.resolve())},
    )
    return info, True


def refuse_other_source(
    ws: Workspace,
    name: str,
    source: str | os.PathLike,
    versions: Sequence[VersionInfo] | None = None,
) -> None:
    """A WorkspaceError unless some version of `name` was imported from `source`: a new
    version under an existing name must be that model edited, not another network that
    happens to share its file name (two folders' model.onnx). `versions`: `name`'s, when the
    caller has read them."""
    wanted = Path(source).resolve()
    versions = versions if versions is not None else ws.versions(name)
    recorded = [v.params.get("source") for v in versions if v.action == "import"]
    if any(s and Path(s).resolve() == wanted for s in recorded):
        return
    origin = next((s for s in recorded if s), None)
    where = f"imported from {origin}" if origin else "not imported from a file"
    raise WorkspaceError(
        f"model {name!r} already exists in workspace {ws.root} ({where}); {wanted} is another file",
        hint="give it another name (--name NAME) to keep it as a separate model",
    )


def open_in_workspace(
    ws: Workspace,
    source: str | os.PathLike,
    name: str | None = None,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[VersionInfo, bool, onnx.ModelProto]:
    """Validate and import a file; reuse the latest version when it is the same unchanged file.

    Returns (version, created, validated model). Validation runs first, so a corrupt, cyclic or
    otherwise broken file raises its typed error before anything is stored. With
    `input_shapes`, the version stored is the model with those input shapes fixed.
    """
    path = Path(source)
    name = name or sanitize_name(path.stem)
    validated = load_model(path, input_shapes)
    exists = name in ws.list_models()
    digest = file_sha256(path) if exists else None
    if exists and not input_shapes and ws.latest(name).sha256 == digest:
        return ws.latest(name), False, validated
    if not input_shapes:
        info, created = _import_or_reuse(ws, path, name, digest)
        return info, created, validated
    if exists:
        refuse_other_source(ws, name, path)
        params = {
            "source": str(path.resolve()),
            "input_shapes": {k: list(v) for k, v in input_shapes.items()},
        }
        info = ws.add_version(
            name, validated, parent=ws.latest(name).version, action="import", params=params
        )
    else:
        info = ws.import_model(
            validated, name, note=f"input shapes fixed: {dict(input_shapes)}", read_from=path
        )
    return info, True, validated


def record_rewrite(
    ws: Workspace, name: str, parent: int, step: RewriteResult, params: dict | None = None
) -> VersionInfo:
    return ws.add_version(
        name,
        step.model,
        parent=parent,
        action=f"rule:{step.rule}",
        params={"nodes": sorted({n for m in step.matches for n in m.nodes}), **(params or {})},
        verify=step.verification.to_dict(),
        coverage=coverage_summary(step.coverage_after),
    )


def record_fix(
    ws: Workspace,
    parent: VersionInfo,
    result: FixResult,
    *,
    allow_approximate: bool = False,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[VersionInfo, dict[str, Any]]:
    """Store a fix's result as one version of `parent`'s model, with the end-to-end check of
    the result against `parent` (each step was verified against the step before it; this is
    the whole chain at once). Returns the version and that verification."""
    from surgery.verify import verify_models

    # the steps rewrote a quantized input's float model: the input differs by its quantization
    floats = result.float_source
    check = verify_models(
        floats if floats is not None else ws.checked_path(parent),
        result.model,
        exact=not allow_approximate,
        inputs=inputs,
    ).to_dict()
    check["model_b"] = "the fixed model (this version)"  # not the ModelProto's repr
    if floats is not None:
        check["reference"] = "the float model of the input (its quantization removed)"
        check["model_a"] = check["reference"]
    version = ws.add_version(
        parent.name,
        result.model,
        parent=parent.version,
        action="fix",
        params={"target": result.target, "steps": [s["rule"] for s in result.steps]},
        verify=check,
        coverage=coverage_summary(result.coverage_after),
    )
    return version, check
