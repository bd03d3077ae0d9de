"""Named, verified graph rewrites: the registry, the engine and the `fix` loop."""

from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.engine import (
    Reference,
    RewriteResult,
    RuleFailedError,
    RuleNotApplicableError,
    apply_rule,
    find_matches,
)
from surgery.rules.registry import all_rules, get_rule, register
from surgery.rules.suggest import enable as _enable_suggestions

_enable_suggestions()

__all__ = [
    "Match",
    "Reference",
    "RewriteResult",
    "Rule",
    "RuleContext",
    "RuleFailedError",
    "RuleNotApplicableError",
    "RuleParams",
    "all_rules",
    "apply_rule",
    "find_matches",
    "get_rule",
    "register",
]
