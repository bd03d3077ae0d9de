"""Tools over the rule registry: list, suggest, apply one rule, and the automatic fix loop."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anyio
import anyio.from_thread
import onnx
from mcp.server.mcpserver import Context, MCPServer
from pydantic import Field

from server.convert import blocker_groups, cap, edit_fields
from server.errors import FileExistsSurgeryError
from server.models import (
    EditOut,
    FixOut,
    FixStep,
    ModelName,
    RuleInfo,
    RuleMatchBrief,
    RulesOut,
    SuggestOut,
    TargetArg,
    VersionArg,
)
from server.state import ServerState
from server.tools._base import register_tool
from surgery.fold import coverage_as_compiled
from surgery.rules import RuleContext, all_rules, get_rule
from surgery.rules import apply_rule as core_apply_rule
from surgery.rules.engine import rewritable_model
from surgery.rules.fix import FixResult, describe_step
from surgery.rules.fix import fix_model as core_fix_model
from surgery.rules.graph_edit import with_unique_node_names
from surgery.rules.suggest import rule_matches
from surgery.session import record_fix, record_rewrite
from surgery.targets import resolve_target
from surgery.workspace import VersionInfo

RuleParamsArg = Annotated[
    dict[str, Any] | None,
    Field(description="Rule parameters (see list_rules: each rule's `params` schema)."),
]


def _rule_matches(ctx: RuleContext) -> tuple[list[RuleMatchBrief], dict[str, list[str]]]:
    """Every rule that applies now, and blocker node -> rules whose matches address it."""
    found: list[tuple[int, int, RuleMatchBrief]] = []
    by_blocker: dict[str, list[str]] = {}
    blockers = ctx.blocker_names
    for rule, matches in rule_matches(ctx):
        addressed = {b for m in matches for b in m.blockers} & blockers
        for b in addressed:
            by_blocker.setdefault(b, []).append(rule.name)
        brief = RuleMatchBrief(
            rule=rule.name,
            category=rule.category,
            exactness=rule.exactness,
            matches=len(matches),
            blockers_removed=len(addressed),
            nodes=cap(sorted({n for m in matches for n in m.nodes}), 20),
            reasons=[m.reason for m in matches[:5]],
        )
        found.append((0 if rule.category == "cleanup" else 1, -len(addressed), brief))
    found.sort(key=lambda t: (t[0], t[1]))
    return [b for _, _, b in found], by_blocker


def _confined_file_params(
    state: ServerState, rule: str, params: dict[str, Any] | None
) -> dict[str, Any] | None:
    """`params` with every file the rule would write checked against the allowed roots (and
    kept out of the workspace, whose versions are immutable): a rule must not be a way around
    export_model's path policy. An existing file is refused, as export_model refuses it."""
    if not params:
        return params
    confined = dict(params)
    for key in get_rule(rule).Params.file_outputs():
        raw = confined.get(key)
        if not isinstance(raw, str):
            continue  # absent, or the wrong type: the rule's own validation names it
        dest = state.output_path(raw)
        if dest.exists():
            raise FileExistsSurgeryError(
                f"parameter {key}: {dest} already exists", hint="choose another path"
            )
        confined[key] = str(dest)
    return confined


def _store_split_off(state: ServerState, parent: VersionInfo, model: onnx.ModelProto) -> str:
    """Keep a model a rule split off (cut-postprocess's tail) in the workspace, as
    `<name>_post`, so later tools can verify or merge it; the note names it."""
    name = f"{parent.name}_post"
    note = f"split off from {parent.name} {parent.id}"
    ws = state.workspace
    if name in ws.list_models():
        info = ws.add_version(
            name, model, parent=ws.latest(name).version, action="split-off", note=note
        )
    else:
        info = ws.import_model(model, name, note=note)
    return f"the split-off model is stored as {info.name!r} {info.id} (merge_models joins it back)"


def register(mcp: MCPServer, state: ServerState) -> None:
    @register_tool(mcp, title="List rewrite rules", read_only=True, idempotent=True)
    def list_rules(
        category: Annotated[
            Literal["cleanup", "rank", "replace", "structure", "placement"] | None,
            Field(description="Only this category."),
        ] = None,
        name: Annotated[
            str | None, Field(description="Only this rule, with its parameters and doc.")
        ] = None,
        detail: Annotated[
            bool, Field(description="Every rule's parameters, example and doc (large).")
        ] = False,
    ) -> RulesOut:
        """The rule catalogue: each rule's summary, category, exactness and whether fix_model
        uses it. Ask for one rule by name (or detail=true) for its parameters and doc."""
        classes = [get_rule(name)] if name else list(all_rules())
        rows = [c.describe() for c in classes if category is None or c.category == category]
        brief = ("params", "example", "doc")
        if not (detail or name):
            rows = [{k: v for k, v in r.items() if k not in brief} for r in rows]
        return RulesOut(rules=[RuleInfo(**r) for r in rows])

    @register_tool(mcp, title="Suggest rules for the blockers", read_only=True, idempotent=True)
    def suggest_rules(
        model: ModelName, version: VersionArg = "latest", target: TargetArg = None
    ) -> SuggestOut:
        """The blockers grouped by reason, each with the rules whose find() matches them, and
        every rule that applies now (most blockers removed first). Apply one with apply_rule,
        or let fix_model choose."""
        info, proto = state.read_only(model, version)
        tgt = resolve_target(target or state.default_target)
        proto, notes = rewritable_model(proto)  # what apply_rule and fix_model rewrite
        named = with_unique_node_names(proto)
        ctx = RuleContext.build(named, tgt)
        rules, by_blocker = _rule_matches(ctx)
        # The segments and blockers as check_model counts them (shapes that wait for folding
        # are read folded); the rules are found on the model as the rules see it.
        cov = coverage_as_compiled(named, ctx.coverage, tgt, [n.name for n in named.graph.node])
        groups = blocker_groups(cov)
        for group, raw in zip(groups, cov.blocker_groups(), strict=True):
            group.suggested_rules = sorted({r for n in raw["nodes"] for r in by_blocker.get(n, [])})
        unaddressed = len(cov.blocker_names - set(by_blocker))
        if cov.single_elf and not cov.blockers:
            advice = "already one MLA segment with no blockers: verify, then quantize and compile"
        elif rules:
            advice = f"apply_rule {rules[0].rule!r} (or fix_model to let the server choose)"
        else:
            advice = (
                "no rule matches the remaining blockers: inspect_node them, then edit the graph, "
                "pin placements with check_model op_target, or cut post-processing"
            )
        return SuggestOut(
            model=info.name,
            version=info.id,
            target=cov.target,
            mla_segments=cov.mla_segments,
            single_elf=cov.single_elf,
            blocker_groups=groups,
            rules=rules,
            unaddressed_blockers=unaddressed,
            next_step=advice,
            notes=notes,
        )

    @register_tool(mcp, title="Apply a rule", read_only=False, idempotent=False)
    def apply_rule(
        model: ModelName,
        rule: Annotated[str, Field(description="Rule name (see list_rules).", min_length=1)],
        version: VersionArg = "latest",
        target: TargetArg = None,
        nodes: Annotated[
            list[str] | None, Field(description="Only matches touching these nodes.")
        ] = None,
        params: RuleParamsArg = None,
    ) -> EditOut:
        """Apply one rule, verify the result numerically against the version it came from,
        and store it as a new version (the old one is kept). A rule that does not apply or
        fails verification is an error and nothing is stored."""
        params = _confined_file_params(state, rule, params)
        parent, proto = state.editable(model, version)
        tgt = target or state.default_target
        result = core_apply_rule(proto, rule, tgt, nodes=nodes, params=params).as_compiled(tgt)
        new = record_rewrite(state.workspace, parent.name, parent.version, result, params)
        split_notes = [
            _store_split_off(state, new, m.split_off) for m in result.matches if m.split_off
        ]
        return EditOut(
            **edit_fields(
                parent,
                new,
                added=result.nodes_added,
                removed=result.nodes_removed,
                verify=result.verification.to_dict(),
                coverage=result.coverage_after,
                segments_before=result.coverage_before.mla_segments,
                notes=[f"{len(result.matches)} match(es) rewritten", *result.notes, *split_notes],
            )
        )

    @register_tool(mcp, title="Fix automatically", read_only=False, idempotent=False)
    async def fix_model(
        ctx: Context,
        model: ModelName,
        version: VersionArg = "latest",
        target: TargetArg = None,
        max_steps: Annotated[
            int, Field(ge=1, le=100, description="Most rules to apply before stopping.")
        ] = 30,
        allow_approximate: Annotated[
            bool, Field(description="Also use rules that change the math within a bound.")
        ] = False,
        skip: Annotated[list[str] | None, Field(description="Rules never to use.")] = None,
    ) -> FixOut:
        """Loop check -> best rule -> apply -> verify -> re-check until the model maps to one
        MLA segment or no rule helps; reports progress after every step. The result is one new
        version, verified end to end against the starting version."""
        parent, proto = state.editable(model, version)
        tgt = target or state.default_target
        await ctx.report_progress(0, max_steps, f"checking {parent.name} {parent.id}")

        def on_step(step: dict[str, Any]) -> None:
            message = describe_step(step, ascii_only=True)
            anyio.from_thread.run(ctx.report_progress, step["step"], max_steps, message)

        def work() -> tuple[FixResult, VersionInfo, dict[str, Any] | None]:
            result = core_fix_model(
                proto,
                tgt,
                max_steps=max_steps,
                allow_approximate=allow_approximate,
                skip=skip or [],
                on_step=on_step,
            )
            if not result.steps:
                return result, parent, None
            new, check = record_fix(
                state.workspace, parent, result, allow_approximate=allow_approximate
            )
            return result, new, check

        result, new, check = await anyio.to_thread.run_sync(work)
        before = {p.name for p in result.coverage_before.placements}
        after = {p.name for p in result.coverage_after.placements}
        done = len(result.steps)
        await ctx.report_progress(
            max_steps,
            max_steps,
            f"done: {done} step(s), {result.coverage_after.mla_segments} segment(s)",
        )
        notes = list(result.notes)
        if check is not None and not check["passed"]:
            notes.append(
                "end-to-end verification against the starting version failed: "
                f"{', '.join(check['failed_outputs'])}; inspect with verify_models"
            )
        if not done and result.coverage_before.single_elf:
            notes.append("already one MLA segment: nothing to fix, no version was added")
        elif not done:
            notes.append("no rule improved the model; no version was added")
        return FixOut(
            **edit_fields(
                parent,
                new,
                added=sorted(after - before),
                removed=sorted(before - after),
                verify=check,
                coverage=result.coverage_after,
                segments_before=result.coverage_before.mla_segments,
                notes=notes,
                action="fix",
            ),
            steps=[
                FixStep(
                    step=s["step"],
                    rule=s["rule"],
                    matches=s["matches"],
                    segments_before=s["segments_before"],
                    segments_after=s["segments_after"],
                    blockers_before=s["blockers_before"],
                    blockers_after=s["blockers_after"],
                    pinned_after=s.get("pinned_after", 0),
                    macs_unknown_nodes_before=s["macs_unknown_nodes_before"],
                    macs_unknown_nodes_after=s["macs_unknown_nodes_after"],
                    verify_passed=s["verify"]["passed"],
                    max_abs=s["verify"]["max_abs"],
                )
                for s in result.steps
            ],
            rejected=[{k: str(v) for k, v in r.items()} for r in result.rejected[:20]],
            remaining_blocker_groups=blocker_groups(result.coverage_after),
        )
