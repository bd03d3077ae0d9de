"""Fills coverage's `suggested_rules`: for each blocker, the rules whose `find` matches it."""

from __future__ import annotations

import onnx

from surgery.coverage import SUGGESTERS, CoverageReport
from surgery.errors import SurgeryError
from surgery.graph import GraphView
from surgery.rules.base import RuleContext
from surgery.rules.registry import all_rules
from surgery.targets import Target


def suggest_rules(
    model: onnx.ModelProto,
    target: Target,
    report: CoverageReport,
    view: GraphView,
    constants: frozenset[str],
) -> dict[str, list[str]]:
    """Blocker node name → names of rules with a match that removes that blocker."""
    ctx = RuleContext(model, target, view, report, constants)
    suggestions: dict[str, list[str]] = {}
    for cls in all_rules():
        rule = cls()
        try:
            matches = rule.find(ctx, rule.Params())
        except (SurgeryError, ValueError, KeyError, IndexError):
            continue  # a rule that cannot analyse this model simply has nothing to suggest
        for m in matches:
            for blocker in m.blockers:
                names = suggestions.setdefault(blocker, [])
                if rule.name not in names:
                    names.append(rule.name)
    return suggestions


def enable() -> None:
    """Register the suggester once (importing surgery.rules does this)."""
    if suggest_rules not in SUGGESTERS:
        SUGGESTERS.append(suggest_rules)
