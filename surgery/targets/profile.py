"""Target profiles: the op table as data, validated with pydantic, and the placement decision.

Profiles live as YAML in `compiler/targets/profiles/` (package data). This module reads them
without importing any compiler code, so `surgery` stays usable alone and `check`, the rewrite
planner, the quantizer and the partitioner all read one table.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import onnx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from surgery.errors import TargetError
from surgery.qdq import DYNAMIC_QUANTIZATION_REASON, is_dynamic_quantization_op
from surgery.targets.constraints import CHECKS, REQUIRED_PARAMS, NodeContext, Reason, describe

Processor = Literal["MLA", "CVU", "APU"]
PROCESSORS: tuple[Processor, ...] = ("MLA", "CVU", "APU")
PROFILE_PACKAGE = "compiler.targets"
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML was built with it: it reads a profile 8× faster than the
pure-Python one (mlsoc: 4 ms instead of 32), which every `surgery` command pays once."""


class ConstraintSpec(BaseModel):
    """One declarative constraint: a registered check name plus its parameters."""

    model_config = ConfigDict(extra="allow", frozen=True)
    check: str

    @model_validator(mode="after")
    def _known_check(self) -> ConstraintSpec:
        if self.check not in CHECKS:
            raise ValueError(f"unknown check {self.check!r}; known: {', '.join(sorted(CHECKS))}")
        missing = REQUIRED_PARAMS[self.check] - set(self.params)
        if missing:
            raise ValueError(
                f"check {self.check!r} needs parameter(s) {', '.join(sorted(missing))}"
            )
        return self

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def describe(self) -> str:
        return describe(self.check, self.params)


class Placement(BaseModel):
    """How one op may run on one processor."""

    model_config = ConfigDict(extra="forbid")
    precisions: list[str] | None = None
    constraints: list[ConstraintSpec] = Field(default_factory=list)
    skip_defaults: list[str] = Field(default_factory=list)
    note: str | None = None


class OpSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    MLA: Placement | None = None
    CVU: Placement | None = None
    APU: Placement | None = None
    note: str | None = None

    def placements(self) -> list[tuple[Processor, Placement]]:
        return [(p, getattr(self, p)) for p in PROCESSORS if getattr(self, p) is not None]


class ProcessorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str
    precisions: list[str] = Field(default_factory=list)
    defaults: list[ConstraintSpec] = Field(default_factory=list)


class TargetProfile(BaseModel):
    """A whole target: processors, their default constraints, and the per-op table."""

    model_config = ConfigDict(extra="forbid")
    name: str
    title: str
    description: str = ""
    source: str = ""
    extends: str | None = None
    hardware: dict[str, Annotated[int | float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="The MLA's throughput constants (quads, macs_per_quad, …): positive numbers.",
    )
    processors: dict[Processor, ProcessorSpec]
    ops: dict[str, OpSpec] = Field(default_factory=dict)
    remove_ops: list[str] = Field(default_factory=list)


class ConstraintEvaluationError(Exception):
    """A constraint raised instead of answering: the node's attributes do not fit its schema,
    or the profile gives the check parameters of the wrong kind (`ranks: four`). The caller,
    which knows the node, turns it into the error a user can act on."""

    def __init__(self, target: str, processor: str, spec: ConstraintSpec, cause: Exception):
        super().__init__(f"{spec.check}: {cause}")
        self.target, self.processor, self.spec, self.cause = target, processor, spec, cause

    def as_target_error(self, node: str, op_type: str) -> TargetError:
        return TargetError(
            f"target {self.target}: the {self.processor} constraint {{check: {self.spec.check}, "
            f"{', '.join(f'{k}: {v}' for k, v in self.spec.params.items())}}} cannot be "
            f"evaluated on node {node!r} ({op_type}): {type(self.cause).__name__}: {self.cause}",
            hint="check the profile's parameters for this check (surgery targets TARGET --op OP)",
        )


@dataclass(slots=True)
class OpDecision:
    """`Target.decide`'s answer (one per node placed; slots, not frozen, for the same reason
    as `NodePlacement`)."""

    processor: Processor
    reasons: list[Reason]
    precisions: list[str]


@dataclass(frozen=True)
class Rule:
    """A resolved placement: constraints including the processor defaults."""

    processor: Processor
    precisions: list[str]
    constraints: tuple[ConstraintSpec, ...]
    checks: tuple[tuple[Any, dict[str, Any]], ...] = ()
    """(check function, params) pairs, resolved once: this is the hot loop of `check`."""


CONTRIB_OPS: dict[str, frozenset[str]] = {"com.microsoft": frozenset({"QuickGelu"})}
"""Ops outside the default domain that profiles place by name: ONNX Runtime's QuickGelu is
what its transformer optimizer fuses x·sigmoid(1.702·x) into (CLIP, ViT exports). Any other
op of a non-default domain is a custom op and runs on the APU."""


def placeable_domain(domain: str, op_type: str) -> bool:
    """Whether a node of `domain` is placed by the profile entry named `op_type`: every op of
    the default domain, and the contrib ops of `CONTRIB_OPS` (a custom op of the same name in
    another domain may compute something else)."""
    return domain in ("", "ai.onnx") or op_type in CONTRIB_OPS.get(domain, frozenset())


class Target:
    """A loaded profile with each op's placement rules resolved once."""

    def __init__(self, profile: TargetProfile) -> None:
        self.profile = profile
        self.name = profile.name
        self._rules: dict[str, tuple[Rule, ...]] = {
            op: self._resolve(spec) for op, spec in profile.ops.items()
        }
        # Ops with an MLA placement, resolved once: `decide` asks for every node of a model.
        self._mla_ops = frozenset(
            op for op, rules in self._rules.items() if any(r.processor == "MLA" for r in rules)
        )
        self.uniform_mla_ranks = self._uniform_mla_ranks()
        """The ranks the MLA takes for the data tensors of every op, when every MLA placement
        checks the same ones (mlsoc: 4-D only); None when some op differs (rk3588's Gemm and
        Flatten skip the check). A node with a data tensor of another rank then cannot run on
        the MLA as whatever op it is rewritten to over that tensor."""

    def _uniform_mla_ranks(self) -> frozenset[int] | None:
        found: set[tuple[int, ...]] = set()
        for rules in self._rules.values():
            for rule in rules:
                if rule.processor != "MLA":
                    continue
                ranks = [c.params for c in rule.constraints if c.check == "rank"]
                if len(ranks) != 1 or ranks[0].get("tensors", "data") != "data":
                    return None
                found.add(tuple(sorted(ranks[0]["ranks"])))
        return frozenset(found.pop()) if len(found) == 1 else None

    def _resolve(self, spec: OpSpec) -> tuple[Rule, ...]:
        rules: list[Rule] = []
        for proc, placement in spec.placements():
            pspec = self.profile.processors.get(proc)
            if pspec is None:
                continue
            own = {c.check for c in placement.constraints}
            defaults = [
                c
                for c in pspec.defaults
                if c.check not in own and c.check not in placement.skip_defaults
            ]
            precisions = (
                placement.precisions if placement.precisions is not None else pspec.precisions
            )
            available = (
                [p for p in precisions if p in pspec.precisions] if pspec.precisions else precisions
            )
            constraints = (*defaults, *placement.constraints)
            checks = tuple((CHECKS[c.check], c.params) for c in constraints)
            rules.append(Rule(proc, available, constraints, checks))
        return tuple(rules)

    @property
    def ops(self) -> dict[str, OpSpec]:
        return self.profile.ops

    def rules_for(self, op_type: str) -> tuple[Rule, ...]:
        return self._rules.get(op_type, ())

    def supports(self, op_type: str, processor: Processor = "MLA") -> bool:
        return any(r.processor == processor and r.precisions for r in self.rules_for(op_type))

    def decide(self, op_type: str, ctx: NodeContext, known_op: bool = True) -> OpDecision:
        """First processor (MLA, then CVU) whose constraints all hold; otherwise the APU."""
        rules = self._rules.get(op_type, ())
        reasons: list[Reason] = []
        if op_type not in self._mla_ops:
            if known_op:
                reasons.append(
                    Reason(
                        "op_not_supported", f"{op_type} is not supported on the MLA of {self.name}"
                    )
                )
            else:
                reasons.append(
                    Reason("unknown_op", f"{op_type} is an unknown op (not in the ONNX standard)")
                )
        for rule in rules:
            if rule.processor == "APU":
                return OpDecision("APU", reasons, rule.precisions)
            if not rule.precisions:
                own = self.profile.ops[op_type]
                wanted = getattr(own, rule.processor).precisions
                reasons.append(
                    Reason(
                        "precision",
                        f"{op_type} runs on the {rule.processor} only in {', '.join(wanted or [])}; "
                        f"{self.name} offers {', '.join(self.profile.processors[rule.processor].precisions)}",
                        rule.processor,
                    )
                )
                continue
            ctx.processor = rule.processor
            failed = None
            try:
                for fn, params in rule.checks:
                    failed = fn(ctx, params)
                    if failed is not None:
                        break
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                pairs = zip(rule.constraints, rule.checks, strict=True)
                spec = next(c for c, check in pairs if check == (fn, params))
                raise ConstraintEvaluationError(self.name, rule.processor, spec, exc) from exc
            if failed is None:
                return OpDecision(rule.processor, reasons, rule.precisions)
            reasons.append(failed)
        return OpDecision("APU", reasons, [])

    def explain(self, op_type: str) -> dict[str, Any]:
        """What the profile says about one op, as data (for `surgery targets T --op OP`).

        A name that is neither in the table nor an ONNX operator is an error with the closest
        names (op types are case-sensitive: "resize" is not Resize)."""
        spec = self.profile.ops.get(op_type)
        if (
            spec is None
            and not onnx.defs.has(op_type)
            and not is_dynamic_quantization_op("", op_type)
        ):
            self._raise_unknown_op(op_type)
        placements = []
        for rule in self.rules_for(op_type):
            placements.append(
                {
                    "processor": rule.processor,
                    "precisions": rule.precisions,
                    "constraints": [
                        {"check": c.check, **c.params, "rule": c.describe()}
                        for c in rule.constraints
                    ],
                }
            )
        if not any(p["processor"] == "APU" for p in placements):
            placements.append(
                {"processor": "APU", "precisions": ["float32"], "constraints": [], "fallback": True}
            )
        return {
            "target": self.name,
            "op": op_type,
            "in_table": spec is not None,
            "on_mla": self.supports(op_type, "MLA"),
            "note": spec.note if spec else self._not_in_table(op_type),
            "placements": placements,
        }

    def _raise_unknown_op(self, op_type: str) -> None:
        known = {*self.profile.ops, *(schema.name for schema in onnx.defs.get_all_schemas())}
        by_case = {name.lower(): name for name in known}
        close = [by_case[op_type.lower()]] if op_type.lower() in by_case else []
        close = close or difflib.get_close_matches(op_type, sorted(known), n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(close)}?" if close else None
        raise TargetError(
            f"unknown op {op_type!r}: not in the {self.name} op table and not an ONNX operator "
            "(custom ops run on the APU)",
            hint=hint,
        )

    def _not_in_table(self, op_type: str) -> str:
        note = f"{op_type} is not in the {self.name} op table: it runs on the APU"
        if is_dynamic_quantization_op("", op_type):
            note += f"; {DYNAMIC_QUANTIZATION_REASON}"
        return note


def profile_dir() -> Path:
    return Path(str(resources.files(PROFILE_PACKAGE) / "profiles"))


def available_targets() -> list[str]:
    return sorted(p.stem for p in profile_dir().glob("*.yaml"))


def _read_profile_data(name_or_path: str) -> tuple[dict[str, Any], str]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise TargetError(
                f"target profile {name_or_path}: no such file",
                hint=f"built-in targets: {', '.join(available_targets())}",
            )
        source = str(path)
    else:
        path = profile_dir() / f"{name_or_path}.yaml"
        source = name_or_path
        if not path.exists():
            raise TargetError(
                f"unknown target {name_or_path!r}; available: {', '.join(available_targets())}",
                hint="or pass the path of a profile .yaml",
            )
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise TargetError(f"target profile {source}: invalid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise TargetError(f"target profile {source}: not UTF-8 text ({exc.reason})") from None
    if not isinstance(data, dict):
        raise TargetError(f"target profile {source}: expected a mapping at the top level")
    return data, source


def _merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    merged = {
        **parent,
        **{k: v for k, v in child.items() if k not in ("ops", "processors", "hardware")},
    }
    merged["hardware"] = {**parent.get("hardware", {}), **child.get("hardware", {})}
    merged["processors"] = {**parent.get("processors", {}), **child.get("processors", {})}
    ops = {**parent.get("ops", {}), **child.get("ops", {})}
    for op in child.get("remove_ops", []):
        ops.pop(op, None)
    merged["ops"] = ops
    merged["extends"] = parent.get("extends")
    merged["remove_ops"] = []
    return merged


@cache
def load_target(name_or_path: str = "mlsoc") -> Target:
    """Load a profile by name (`mlsoc`, `modalix`, `rk3588`) or path, resolving `extends`."""
    if isinstance(name_or_path, Target):  # pragma: no cover - convenience for callers
        return name_or_path
    data, source = _read_profile_data(name_or_path)
    seen = {data.get("name")}
    while data.get("extends"):
        parent_name = data["extends"]
        if parent_name in seen:
            raise TargetError(f"target profile {source}: 'extends' loops through {parent_name!r}")
        seen.add(parent_name)
        parent, _ = _read_profile_data(parent_name)
        data = _merge(parent, data)
    try:
        profile = TargetProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise TargetError(
            f"target profile {source}: {where}: {first['msg']} ({exc.error_count()} error(s))"
        ) from None
    return Target(profile)


def resolve_target(target: str | os.PathLike | Target) -> Target:
    if isinstance(target, Target):
        return target
    if not isinstance(target, str | os.PathLike):
        raise TargetError(
            f"target must be a profile name or path, got {type(target).__name__}",
            hint=f"built-in targets: {', '.join(available_targets())}",
        )
    return load_target(str(target))
