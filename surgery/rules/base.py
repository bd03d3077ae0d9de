"""The rule contract: a named, verifiable graph rewrite with `find` and `apply`.

`find` reads the model (with its coverage on a target) and says where the rule applies and which
blockers each match removes; `apply` edits an onnx-graphsurgeon graph. The engine does the rest
(cleanup, shape inference, checker, numerical verification, coverage, versioning), so a rule is
only the pattern and the edit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Literal

import onnx
import onnx_graphsurgeon as gs
from pydantic import BaseModel, ConfigDict

from surgery.coverage import (
    CoverageReport,
    analyze_coverage,
    constant_tensors,
    topo_order,
)
from surgery.graph import GraphView, default_opset
from surgery.targets import Reason, Target, resolve_target

Exactness = Literal["exact", "approximate"]
Category = Literal["cleanup", "rank", "replace", "structure", "placement"]


WRITES_FILE: dict[str, Any] = {"writes_file": True}
"""`json_schema_extra` of a parameter that names a file the rule writes: callers that confine
paths (the MCP server) check such parameters before the rule runs."""


class RuleParams(BaseModel):
    """Parameters of a rule (none by default). Subclass per rule; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def file_outputs(cls) -> list[str]:
        """Names of the parameters marked WRITES_FILE."""
        return [
            name
            for name, info in cls.model_fields.items()
            if isinstance(info.json_schema_extra, dict)
            and info.json_schema_extra.get("writes_file")
        ]


@dataclass
class Match:
    """One place where a rule applies."""

    rule: str
    nodes: list[str]
    """The nodes the rewrite changes or removes."""
    reason: str
    """What the rewrite does here, in one line."""
    blockers: list[str] = field(default_factory=list)
    """Blocker nodes (from coverage) whose reason this match removes."""
    data: dict[str, Any] = field(default_factory=dict)
    """Private to the rule: whatever `apply` needs from `find`."""
    split_off: onnx.ModelProto | None = None
    """A model the rewrite splits off beside the rewritten one (cut-postprocess's tail), for
    callers that keep it (the MCP server stores it in the workspace)."""
    fixed_inputs: dict[str, Any] = field(default_factory=dict)
    """Graph inputs the rewrite fixes to one value and removes (inline-if-branch's condition):
    the parent is verified with them fed so."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "nodes": self.nodes,
            "reason": self.reason,
            "blockers": self.blockers,
        }


@dataclass
class RuleContext:
    """What `find` may read: the shape-inferred model, its index, constants and coverage."""

    model: onnx.ModelProto
    target: Target
    view: GraphView
    coverage: CoverageReport
    constants: frozenset[str]
    focus: frozenset[str] | None = field(default=None, compare=False)
    """Blocker names set by `surgery check`'s suggestions, which want only matches that list one
    of them: a rule may then skip pattern anchors no such match can involve (`near_focus`).
    None (`surgery fix`, `apply`, the MCP tools): every match is wanted."""
    probes: dict[tuple, Reason | None] = field(default_factory=dict, repr=False, compare=False)
    """Placement answers of one-node probes by signature (`replace_common.probe_node`): a
    model repeats the same patterns (57 SiLUs in a YOLO) and `surgery check` asks every rule,
    so each distinct probe is placed once per analysis, never reused across models."""

    @classmethod
    def build(
        cls, model: onnx.ModelProto, target: str | Target, view: GraphView | None = None
    ) -> RuleContext:
        tgt = resolve_target(target)
        view = view or GraphView(model)
        constants, _ = constant_tensors(view, topo_order(view))
        coverage = analyze_coverage(model, tgt, view=view, suggest=False)
        return cls(model, tgt, view, coverage, frozenset(constants))

    @property
    def blocker_names(self) -> frozenset[str]:
        return self.coverage.blocker_names

    @cached_property
    def opset(self) -> int:
        """The model's default-domain opset (1 when it declares none); rules ask per node."""
        return default_opset(self.model)

    def placement(self, node_name: str):
        return self.coverage.by_name(node_name)

    def near_focus(self, reach: int) -> frozenset[int] | None:
        """Indices of the nodes within `reach` edges (either direction) of a focus blocker, or
        None when there is no focus. A rule whose patterns span at most d edges may skip anchors
        outside `near_focus(3 * d)`: such an anchor's match can neither contain a focus blocker
        nor overlap (and so change) the match of an anchor that does."""
        if self.focus is None:
            return None
        view = self.view
        index = view.index_by_name
        frontier = {index[name] for name in self.focus if name in index}
        near = set(frontier)
        for _ in range(reach):
            step: set[int] = set()
            for idx in frontier:
                step.update(view.successors(idx))
                step.update(view.predecessors(idx))
            frontier = step - near
            if not frontier:
                break
            near |= frontier
        return frozenset(near)


class Rule:
    """Base class. Subclasses set the class attributes and implement `find` and `apply`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    category: ClassVar[Category]
    exactness: ClassVar[Exactness] = "exact"
    error_bound: ClassVar[float] = 0.0
    """For approximate rules: the largest max_rel (error / max|ref|) verification accepts."""
    Params: ClassVar[type[RuleParams]] = RuleParams
    example: ClassVar[str] = ""
    changes_outputs: ClassVar[bool] = False
    """True only for rules that change the model's outputs on purpose (e.g. cut-postprocess)."""
    auto: ClassVar[bool] = True
    """Whether `surgery fix` may pick this rule by itself."""
    suggest_for: ClassVar[frozenset[str] | None] = None
    """Op types such that the rule's matches list blockers only when some blocker has one of
    them (it frees only such nodes, or only matches around such a blocker). `surgery check`
    then skips the rule on models without one; None (the default) always asks the rule."""
    keeps_ranks: ClassVar[bool] = False
    """True when every node the rewrite puts in place of a node reads or writes one of that
    node's data tensors (or one of the same shape): an elementwise or activation rewrite, a
    Split as Slices. On a target whose MLA takes one set of ranks for every op
    (`Target.uniform_mla_ranks`), such a rule cannot free a blocker with a data tensor of
    another rank, so `surgery check` does not ask it when every blocker has one (a YOLO
    head's rank-5 tensors, a transformer's rank-3 tokens)."""

    def may_free(self, coverage: CoverageReport) -> bool:
        """False only when `find` cannot list any of the report's blockers (a cheap pre-check
        that keeps rule suggestions from pattern-matching the whole graph for nothing)."""
        ops = self.suggest_for
        return ops is None or not ops.isdisjoint(coverage.blocker_op_types)

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        raise NotImplementedError

    def apply(self, graph: gs.Graph, match: Match, params: RuleParams, ctx: RuleContext) -> None:
        raise NotImplementedError

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        """Apply matches one by one, skipping those whose nodes an earlier match rewrote.

        Rules whose edit is global (e.g. constant folding) override this to edit once.
        """
        applied = []
        for m in matches:
            live = {n.name for n in graph.nodes if n.outputs}  # detached nodes await cleanup
            if not set(m.nodes) <= live:
                continue
            self.apply(graph, m, params, ctx)
            applied.append(m)
        return applied

    def match(
        self, nodes: list[str], reason: str, blockers: list[str] | None = None, **data: Any
    ) -> Match:
        return Match(self.name, nodes, reason, blockers or [], data)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "name": cls.name,
            "summary": cls.summary,
            "category": cls.category,
            "exactness": cls.exactness,
            "error_bound": cls.error_bound if cls.exactness == "approximate" else None,
            "params": cls.Params.model_json_schema().get("properties", {}),
            "example": cls.example,
            "changes_outputs": cls.changes_outputs,
            "auto": cls.auto,
            "doc": inspect.cleandoc(cls.__doc__ or ""),
        }
