"""Fills coverage's `suggested_rules`: for each blocker, the rules whose `find` matches it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import onnx

from surgery.coverage import SUGGESTERS, CoverageReport
from surgery.errors import MalformedTensorError, SurgeryError, first_line
from surgery.graph import GraphView
from surgery.rules.base import Match, Rule, RuleContext
from surgery.rules.registry import all_rules
from surgery.schema_check import raise_malformed
from surgery.targets import NodeContext, Target

log = logging.getLogger(__name__)


def rule_matches(
    ctx: RuleContext, rules: Sequence[Rule] | None = None
) -> list[tuple[Rule, list[Match]]]:
    """Every rule (in registry order) that applies to the model in `ctx`, with its matches.

    The one loop behind suggestions, `surgery fix`'s choice and the MCP `suggest_rules` tool.
    A rule that cannot analyse a model (it raises while pattern-matching) simply does not apply;
    one that refuses with a SurgeryError (fix-input-shapes without shapes for a dynamic
    height) does not apply either, without the warning a bug gets.
    """
    found = []
    for rule in rules if rules is not None else [cls() for cls in all_rules()]:
        try:
            matches = rule.find(ctx, rule.Params())
        except MalformedTensorError:
            raise  # a damaged weight is the model's problem, not this rule's
        except SurgeryError as refusal:  # the rule's own word that it needs parameters
            log.debug("rule %s does not apply: %s", rule.name, refusal)
            continue
        except Exception as error:  # noqa: BLE001 - one rule's bug must not break check or fix
            raise_malformed(ctx.model)  # a float perm or a truncated weight is the problem
            # One line on a user's terminal; the traceback for whoever debugs the rule.
            log.warning(
                "rule %s could not analyse the model (%s: %s); it is not suggested",
                rule.name,
                type(error).__name__,
                first_line(error),
            )
            log.debug("rule %s failed", rule.name, exc_info=True)
            continue
        if matches:
            found.append((rule, matches))
    return found


def suggest_rules(
    model: onnx.ModelProto,
    target: Target,
    report: CoverageReport,
    view: GraphView,
    constants: frozenset[str],
) -> dict[str, list[str]]:
    """Blocker node name → names of rules with a match that removes that blocker, those that
    keep the model whole first: cut-postprocess frees a head's blockers by moving its work
    to the host, which reshape-to-4d keeps on the MLA."""
    ctx = RuleContext(model, target, view, report, constants, focus=report.blocker_names)
    rules = [rule for rule in (cls() for cls in all_rules()) if rule.may_free(report)]
    if any(rule.keeps_ranks for rule in rules) and _all_blocked_by_rank(report, target, ctx):
        rules = [rule for rule in rules if not rule.keeps_ranks]
    rules.sort(key=lambda rule: rule.changes_outputs)
    suggestions: dict[str, list[str]] = {}
    for rule, matches in rule_matches(ctx, rules):
        for m in matches:
            for blocker in m.blockers:
                names = suggestions.setdefault(blocker, [])
                if rule.name not in names:
                    names.append(rule.name)
    return suggestions


def _all_blocked_by_rank(report: CoverageReport, target: Target, ctx: RuleContext) -> bool:
    """Whether every blocker has a data tensor (the tensors the rank check reads: computed
    inputs and outputs) of a rank the target's MLA takes for no op, or of unknown rank: no
    `keeps_ranks` rule can free one."""
    ranks = target.uniform_mla_ranks
    if ranks is None:
        return False

    def off_rank(idx: int) -> bool:
        node = NodeContext(ctx.view, idx, ctx.constants)
        return any(t.rank not in ranks for t in (*node.data_inputs(), *node.outputs()))

    return all(off_rank(b.index) for b in report.blockers)


def enable() -> None:
    """Register the suggester once (importing surgery.rules does this)."""
    if suggest_rules not in SUGGESTERS:
        SUGGESTERS.append(suggest_rules)
