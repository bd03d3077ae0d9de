"""Mapping core results (surgery dataclasses and their dicts) onto the edge models, trimmed.

Kept apart from the tools so each tool body reads as "call the core, convert, return".
"""

from __future__ import annotations

from typing import Any

from server.models import (
    Blocker,
    BlockerGroup,
    CoverageBrief,
    Page,
    SegmentBrief,
    SummaryOut,
    Tensor,
    VerifyBrief,
    VersionOut,
)
from server.wording import tool_words
from surgery.coverage import CoverageReport
from surgery.session import coverage_summary
from surgery.summary import ModelSummary
from surgery.workspace import VersionInfo, version_id

GROUP_NODES = 20
NAME_LIST = 50


def cap(items: list[Any], n: int = NAME_LIST) -> list[Any]:
    return list(items[:n])


def page(items: list[Any], offset: int, limit: int) -> tuple[list[Any], Page]:
    chunk = items[offset : offset + limit]
    return chunk, Page.of(len(items), offset, len(chunk))


def summary_out(info: VersionInfo, s: ModelSummary, top_ops: int = 20) -> SummaryOut:
    hist = s.op_histogram
    return SummaryOut(
        model=info.name,
        version=info.id,
        graph_name=s.graph_name,
        opsets=s.opsets,
        producer=s.producer,
        inputs=[Tensor(**t) for t in s.inputs],
        outputs=[Tensor(**t) for t in s.outputs],
        nodes=s.nodes,
        op_histogram=dict(list(hist.items())[:top_ops]),
        other_op_types=max(0, len(hist) - top_ops),
        parameters=s.parameters,
        parameter_bytes=s.parameter_bytes,
        dynamic_dims=s.dynamic_dims,
        custom_domains=s.custom_domains,
    )


def coverage_brief(cov: CoverageReport) -> CoverageBrief:
    return CoverageBrief(**coverage_summary(cov))


def blocker_groups(cov: CoverageReport, group_nodes: int = GROUP_NODES) -> list[BlockerGroup]:
    return [
        BlockerGroup(
            code=g["code"],
            reason=tool_words(g["reason"]),
            count=g["count"],
            op_types=g["op_types"],
            nodes=cap(g["nodes"], group_nodes),
            suggested_rules=g["suggested_rules"],
        )
        for g in cov.blocker_groups()
    ]


def blockers(cov: CoverageReport) -> list[Blocker]:
    return [
        Blocker(
            node=b.name,
            op_type=b.op_type,
            processor=b.processor,
            reasons=[tool_words(r.message) for r in b.reasons],
            suggested_rules=list(b.suggested_rules),
        )
        for b in cov.blockers
    ]


def segments(cov: CoverageReport) -> list[SegmentBrief]:
    return [
        SegmentBrief(
            name=s.name,
            node_count=len(s.nodes),
            inputs=cap(s.inputs, 20),
            outputs=cap(s.outputs, 20),
            macs=s.macs,
        )
        for s in cov.segments
    ]


def verify_brief(data: dict[str, Any] | None, reference: str | None = None) -> VerifyBrief | None:
    """From an engine Verification dict, a VerifyResult dict, or a stored history record."""
    if not data:
        return None
    worst = data.get("worst") or {}
    max_abs = data.get("worst_max_abs", worst.get("max_abs"))
    return VerifyBrief(
        passed=bool(data.get("passed")),
        mode=str(data.get("mode", "")),
        worst_max_abs=_num(max_abs),
        worst_max_rel=_num(data.get("worst_max_rel")),
        reference=reference or data.get("reference"),
        note=data.get("note"),
    )


def _num(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    if value == "inf":
        return float("inf")
    return None


def version_out(info: VersionInfo) -> VersionOut:
    params = {k: (cap(v, 20) if isinstance(v, list) else v) for k, v in (info.params or {}).items()}
    return VersionOut(
        version=info.id,
        parent=info.parent_id,
        action=info.action,
        created=info.created,
        params=params,
        verify=verify_brief(
            info.verify, version_id(info.parent) if info.parent is not None else None
        ),
        coverage=info.coverage,
        note=info.note,
    )


def edit_fields(
    parent: VersionInfo,
    new: VersionInfo,
    *,
    added: list[str],
    removed: list[str],
    verify: dict[str, Any] | None,
    coverage: CoverageReport,
    segments_before: int,
    notes: list[str] | None = None,
    action: str | None = None,
) -> dict[str, Any]:
    """The fields every editing tool returns (EditOut), from its parent and new version."""
    return dict(
        model=new.name,
        version=new.id,
        parent=parent.id,
        action=action or new.action,
        changed=(new.name, new.version) != (parent.name, parent.version),
        nodes_added=cap(added),
        nodes_added_count=len(added),
        nodes_removed=cap(removed),
        nodes_removed_count=len(removed),
        verify=verify_brief(verify, parent.id),
        coverage=coverage_brief(coverage),
        mla_segments_before=segments_before,
        notes=[tool_words(n) for n in notes or []],
    )
