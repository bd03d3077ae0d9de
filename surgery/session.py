"""Rewrites recorded in a workspace: the glue the CLI and the MCP server share.

A model enters the workspace once (v0 = the user's file, untouched at its source); each
applied rule or fix step becomes a new version whose history record carries the rule, its
parameters, the verification metrics and the coverage summary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import onnx

from surgery.coverage import CoverageReport
from surgery.rules.engine import RewriteResult
from surgery.workspace import VersionInfo, Workspace, sanitize_name


def coverage_summary(cov: CoverageReport) -> dict[str, Any]:
    return {
        "target": cov.target,
        "mla_segments": cov.mla_segments,
        "single_elf": cov.single_elf,
        "blockers": len(cov.blockers),
        "mla_mac_fraction": round(cov.mla_mac_fraction, 6),
    }


def import_or_reuse(
    ws: Workspace, source: str | os.PathLike, name: str | None = None
) -> VersionInfo:
    """Import the file as a model (or, if that name exists, as a new version of it)."""
    name = name or sanitize_name(Path(source).stem)
    if name in ws.list_models():
        from surgery.model import read_model

        latest = ws.latest(name)
        return ws.add_version(
            name,
            read_model(source),
            parent=latest.version,
            action="import",
            params={"source": str(source)},
        )
    return ws.import_model(source, name)


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


def record_model(
    ws: Workspace, name: str, parent: int, model: onnx.ModelProto, action: str, **extra: Any
) -> VersionInfo:
    return ws.add_version(name, model, parent=parent, action=action, **extra)
