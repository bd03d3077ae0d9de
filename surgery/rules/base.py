"""The rule contract: a named, verifiable graph rewrite with `find` and `apply`.

`find` reads the model (with its coverage on a target) and says where the rule applies and which
blockers each match removes; `apply` edits an onnx-graphsurgeon graph. The engine does the rest
(cleanup, shape inference, checker, numerical verification, coverage, versioning), so a rule is
only the pattern and the edit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import onnx
import onnx_graphsurgeon as gs
from pydantic import BaseModel, ConfigDict

from surgery.coverage import CoverageReport, analyze_coverage, constant_tensors, topo_order
from surgery.graph import GraphView
from surgery.targets import Target, resolve_target

Exactness = Literal["exact", "approximate"]
Category = Literal["cleanup", "rank", "replace", "structure", "placement"]


class RuleParams(BaseModel):
    """Parameters of a rule (none by default). Subclass per rule; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


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
    def blocker_names(self) -> set[str]:
        return {b.name for b in self.coverage.blockers}

    def placement(self, node_name: str):
        return self.coverage.by_name(node_name)


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
