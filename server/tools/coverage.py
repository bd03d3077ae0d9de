"""Tools that answer "where does each node run on this target, and why not on the MLA"."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

from server.convert import blocker_groups, blockers, page, segments
from server.models import (
    CheckOut,
    ExplainOpOut,
    LimitArg,
    ModelName,
    OffsetArg,
    TargetArg,
    TargetBrief,
    TargetsOut,
    VersionArg,
)
from server.state import ServerState
from server.tools._base import register_tool
from surgery.check import check_model as core_check_model
from surgery.targets import available_targets, load_target

OpTarget = Annotated[
    dict[str, str] | None,
    Field(
        description="Pin placements: {node name or op type: 'MLA'|'CVU'|'APU'}, e.g. "
        '{"NonMaxSuppression": "APU"}.'
    ),
]


def register(mcp: MCPServer, state: ServerState) -> None:
    @register_tool(mcp, title="Check coverage on a target", read_only=True, idempotent=True)
    def check_model(
        model: ModelName,
        version: VersionArg = "latest",
        target: TargetArg = None,
        op_target: OpTarget = None,
        limit: LimitArg = 50,
        offset: OffsetArg = 0,
        group_nodes: Annotated[
            int, Field(ge=0, le=500, description="Node names listed per blocker group.")
        ] = 20,
    ) -> CheckOut:
        """Which nodes run on the MLA / CVU / APU, how many MLA segments (= .elf files) a
        compile would produce, and why each blocker is blocked (grouped by reason, with the
        rules that would fix it). Blockers are paged with limit/offset."""
        info, proto = state.read_only(model, version)
        cov = core_check_model(proto, target or state.default_target, op_target=op_target)
        data = cov.to_dict()
        chunk, pg = page(blockers(cov), offset, limit)
        return CheckOut(
            model=info.name,
            version=info.id,
            target=cov.target,
            nodes_total=data["nodes_total"],
            processors=data["processors"],
            foldable_nodes=data["foldable_nodes"],
            mla_segments=cov.mla_segments,
            single_elf=cov.single_elf,
            macs_total=data["macs_total"],
            mla_mac_fraction=data["mla_mac_fraction"],
            macs_unknown_nodes=data["macs_unknown_nodes"],
            dynamic_inputs=data["dynamic_inputs"],
            segments=segments(cov),
            blocker_groups=blocker_groups(cov, group_nodes),
            blockers_page=pg,
            blockers=chunk,
        )

    @register_tool(mcp, title="List target profiles", read_only=True, idempotent=True)
    def list_targets() -> TargetsOut:
        """The target profiles (op tables) this server knows, with their MLA precisions."""
        rows = []
        for name in available_targets():
            t = load_target(name)
            rows.append(
                TargetBrief(
                    name=name,
                    title=t.profile.title,
                    mla_precisions=t.profile.processors["MLA"].precisions,
                    mla_ops=sum(1 for o in t.ops if t.supports(o, "MLA")),
                    resource=f"surgery://targets/{name}",
                )
            )
        return TargetsOut(targets=rows, default=state.default_target)

    @register_tool(mcp, title="Explain an op on a target", read_only=True, idempotent=True)
    def explain_op(
        op: Annotated[str, Field(description="ONNX op type, e.g. 'Resize'.", min_length=1)],
        target: TargetArg = None,
    ) -> ExplainOpOut:
        """Which processors can run an op on a target, in which precisions, under which
        constraints (each with the rule text a blocker reason quotes)."""
        return ExplainOpOut(**load_target(target or state.default_target).explain(op))
