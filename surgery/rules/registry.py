"""The rule registry: one place that knows every rule by name."""

from __future__ import annotations

import difflib
from functools import cache

from surgery.errors import SurgeryError
from surgery.rules.base import Rule

_RULES: dict[str, type[Rule]] = {}


class UnknownRuleError(SurgeryError):
    code = "unknown_rule"


def register(cls: type[Rule]) -> type[Rule]:
    """Class decorator: add a rule to the registry under its kebab-case name."""
    if cls.name in _RULES and _RULES[cls.name] is not cls:
        raise ValueError(f"rule {cls.name!r} registered twice")
    _RULES[cls.name] = cls
    return cls


def get_rule(name: str) -> Rule:
    _load_catalogue()
    cls = _RULES.get(name)
    if cls is None:
        spelled = name.strip().lower().replace("_", "-").replace(" ", "-")
        close = difflib.get_close_matches(spelled, list(_RULES), n=3, cutoff=0.7)
        close = close or [n for n in _RULES if spelled.split("-")[0] in n][:5]
        raise UnknownRuleError(
            f"unknown rule {name!r}",
            hint=f"did you mean {', '.join(close)}?" if close else "list them with `surgery rules`",
        )
    return cls()


def all_rules() -> list[type[Rule]]:
    """Every rule, in priority order: the catalogue's module order, then definition order."""
    _load_catalogue()
    return list(_prioritised(tuple(_RULES.values())))


@cache
def _prioritised(registered: tuple[type[Rule], ...]) -> tuple[type[Rule], ...]:
    """`registered` in priority order, sorted once per set of rules (every check asks)."""
    from surgery.rules.catalogue import MODULES

    def priority(cls: type[Rule]) -> tuple[int, int]:
        module = cls.__module__.rpartition(".")[2]
        rank = MODULES.index(module) if module in MODULES else len(MODULES)
        return rank, registered.index(cls)

    return tuple(sorted(registered, key=priority))


def _load_catalogue() -> None:
    from surgery.rules import catalogue  # noqa: F401  (importing registers the rules)
