"""Applying a rule: find → edit → cleanup → shape inference → checker → verify → coverage.

Every application produces a new ModelProto or raises; the input model is never modified, so a
failed rule is rolled back by construction. Verification compares the new model with its parent
on seeded inputs: exact rules to float rounding, approximate rules to their declared bound.
Models whose outputs follow a selection (TopK, ArgMax, NMS), whose tie order float rounding may
flip, are compared stage by stage when their outputs differ (`surgery.rules.selection`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
from pydantic import ValidationError

from surgery.coverage import CoverageReport
from surgery.errors import SurgeryError
from surgery.fold import coverage_as_compiled
from surgery.graph import GraphView
from surgery.model import check_model_fully, load_model, outputs_as_inferred
from surgery.qdq import REWRITTEN_AS_FLOAT_NOTE, float_model, is_quantized
from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.graph_edit import export_graph, import_graph, with_unique_node_names
from surgery.rules.registry import get_rule
from surgery.rules.selection import compare_by_stages
from surgery.targets import Target, resolve_target
from surgery.verify import OutputComparison, compare_arrays, make_inputs, ort_session, run_model


class RuleNotApplicableError(SurgeryError):
    code = "rule_not_applicable"


class RuleFailedError(SurgeryError):
    """The rewrite broke the model (checker, shape inference) or failed verification."""

    code = "rule_failed"


class RuleParamsError(SurgeryError):
    code = "bad_rule_params"


@dataclass
class Reference:
    """Inputs and outputs of the parent model, computed once and reused for each child."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]

    @classmethod
    def of(
        cls, model: onnx.ModelProto, inputs: Mapping[str, np.ndarray] | None = None, seed: int = 0
    ) -> Reference:
        feed = dict(inputs) if inputs is not None else make_inputs(model, seed=seed)
        return cls(feed, run_model(ort_session(model, label="parent model"), feed))


@dataclass
class Verification:
    passed: bool
    mode: str
    bound: float
    outputs: list[OutputComparison]
    note: str | None = None
    """Set when the outputs follow a selection (TopK …) and the models were compared stage by
    stage, each stage fed the parent's values (`surgery.rules.selection`)."""

    @property
    def worst_max_rel(self) -> float:
        return max((o.max_rel or 0.0 for o in self.outputs if o.max_rel is not None), default=0.0)

    @property
    def worst_max_abs(self) -> float:
        return max((o.max_abs or 0.0 for o in self.outputs if o.max_abs is not None), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "mode": self.mode,
            "bound": self.bound,
            "worst_max_abs": self.worst_max_abs,
            "worst_max_rel": self.worst_max_rel,
            "outputs": [o.to_dict() for o in self.outputs],
            **({"note": self.note} if self.note else {}),
        }


@dataclass
class RewriteResult:
    rule: str
    model: onnx.ModelProto
    matches: list[Match]
    verification: Verification
    coverage_before: CoverageReport
    coverage_after: CoverageReport
    nodes_added: list[str] = field(default_factory=list)
    nodes_removed: list[str] = field(default_factory=list)
    reference: Reference | None = None
    """The child's own outputs on the same inputs: the reference for the next step."""
    notes: list[str] = field(default_factory=list)
    source: onnx.ModelProto | None = None
    """The model the rule rewrote, its nodes named as `coverage_before` labels them."""

    def as_compiled(self, target: str | Target) -> RewriteResult:
        """This result with the coverage before and after as `surgery check` counts it:
        where shapes wait for folding, that of the folded model (the one a compile sees).
        The rule engine and fix judge the models as they are; what `apply` reports and
        records are check's numbers, or a cut of fcos would read "segments 1 → 1"."""
        before, after = self.coverage_before, self.coverage_after
        if self.source is not None:
            before = coverage_as_compiled(self.source, before, target, _labels(before))
        after = coverage_as_compiled(self.model, after, target, _labels(after))
        return replace(self, coverage_before=before, coverage_after=after)

    def summary(self) -> dict[str, Any]:
        before, after = self.coverage_before, self.coverage_after
        return {
            "rule": self.rule,
            "matches": [m.to_dict() for m in self.matches],
            "nodes_added": self.nodes_added,
            "nodes_removed": self.nodes_removed,
            "verify": self.verification.to_dict(),
            "mla_segments_before": before.mla_segments,
            "mla_segments_after": after.mla_segments,
            "blockers_before": len(before.blockers),
            "blockers_after": len(after.blockers),
            "mla_mac_fraction_before": round(before.mla_mac_fraction, 6),
            "mla_mac_fraction_after": round(after.mla_mac_fraction, 6),
            "macs_unknown_nodes_before": before.macs_unknown_nodes,
            "macs_unknown_nodes_after": after.macs_unknown_nodes,
            "notes": self.notes,
        }


def _labels(report: CoverageReport) -> list[str]:
    return [p.name for p in report.placements]


def parse_params(rule: Rule, params: Mapping[str, Any] | RuleParams | None) -> RuleParams:
    if isinstance(params, RuleParams):
        return params
    try:
        return rule.Params.model_validate(dict(params or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "params"
        raise RuleParamsError(f"rule {rule.name!r}: parameter {where}: {first['msg']}") from None


def find_matches(
    model: onnx.ModelProto,
    rule: Rule | str,
    target: str | Target = "mlsoc",
    *,
    params: Mapping[str, Any] | RuleParams | None = None,
    ctx: RuleContext | None = None,
) -> list[Match]:
    """Where a rule applies (no edit)."""
    rule = get_rule(rule) if isinstance(rule, str) else rule
    ctx = ctx or RuleContext.build(with_unique_node_names(model), target)
    return rule.find(ctx, parse_params(rule, params))


def rewritable_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The model rules rewrite, and the notes that say what it is: a quantized model's float
    model (rules match float graphs: see `float_model`), to be quantized again."""
    if not is_quantized(GraphView(model)):
        return model, []
    return load_model(float_model(model)), [REWRITTEN_AS_FLOAT_NOTE]


def apply_rule(
    model: onnx.ModelProto,
    rule: Rule | str,
    target: str | Target = "mlsoc",
    *,
    nodes: Sequence[str] | None = None,
    params: Mapping[str, Any] | RuleParams | None = None,
    reference: Reference | None = None,
    ctx: RuleContext | None = None,
    verify: bool = True,
    progress: Callable[[str], None] | None = None,
) -> RewriteResult:
    """Apply every match of `rule` (or those touching `nodes`) and return the verified result.

    `model` must be shape-inferred (as `load_model` returns it). Raises RuleNotApplicableError
    when nothing matches, RuleFailedError when the result is invalid or fails verification.
    """
    rule = get_rule(rule) if isinstance(rule, str) else rule
    tgt = resolve_target(target)
    p = parse_params(rule, params)
    notes: list[str] = []
    if ctx is None:
        model, notes = rewritable_model(model)
    model = with_unique_node_names(model)
    ctx = ctx or RuleContext.build(model, tgt)
    matches = rule.find(ctx, p)
    if nodes:
        wanted = set(nodes)
        unknown = wanted - set(ctx.view.names)
        if unknown:
            raise RuleNotApplicableError(f"no node named {', '.join(sorted(unknown))} in the model")
        matches = [m for m in matches if wanted & set(m.nodes)]
    if not matches:
        where = f" at {', '.join(nodes)}" if nodes else ""
        raise RuleNotApplicableError(
            f"rule {rule.name!r} does not apply{where}: nothing in the model matches it",
            hint="`surgery check` lists the blockers with the rules that match them",
        )
    if progress:
        progress(f"{rule.name}: {len(matches)} match(es)")
    graph = import_graph(model)
    try:
        applied = rule.apply_all(graph, matches, p, ctx)
    except SurgeryError:
        raise
    except Exception as exc:  # a rule bug must not take the caller down with it
        raise RuleFailedError(
            f"rule {rule.name!r} failed while editing: {type(exc).__name__}: {exc}"
        ) from exc
    new = _finalise(export_graph(graph, model), rule)
    before_names = set(ctx.view.names)
    after_ctx = RuleContext.build(new, tgt)
    after_names = set(after_ctx.view.names)
    verification, child_reference = (
        _verify(rule, model, new, reference, _fixed_inputs(applied))
        if verify
        else (
            Verification(True, "skipped", 0.0, []),
            None,
        )
    )
    if not verification.passed:
        worst = max(verification.outputs, key=lambda o: o.max_rel or 0.0, default=None)
        detail = worst.message or f"max_rel {worst.max_rel:.3g}" if worst else "no outputs compared"
        raise RuleFailedError(
            f"rule {rule.name!r} changed the model's outputs beyond its bound "
            f"({verification.mode}, {detail}); the rewrite was rolled back"
        )
    return RewriteResult(
        rule=rule.name,
        model=new,
        matches=applied,
        verification=verification,
        coverage_before=ctx.coverage,
        coverage_after=after_ctx.coverage,
        nodes_added=sorted(after_names - before_names),
        nodes_removed=sorted(before_names - after_names),
        reference=child_reference,
        notes=notes,
        source=model,
    )


def _finalise(model: onnx.ModelProto, rule: Rule) -> onnx.ModelProto:
    """Re-infer shapes and run the full checker; any failure is the rule's fault, unless it
    is a graph output's declared shape that inference now contradicts (an exporter's
    mistake the rewrite only brought to light): such outputs take the inferred shape."""
    try:
        return _checked(model)
    except _INVALID as exc:
        error = exc
    try:
        repaired, renamed = outputs_as_inferred(model)
        if renamed:
            return _checked(repaired)
    except _INVALID:
        pass
    if isinstance(error, SurgeryError):
        raise RuleFailedError(
            f"rule {rule.name!r} produced an invalid model: {error.message}"
        ) from None
    first = str(error).strip().splitlines()[0][:300]
    raise RuleFailedError(f"rule {rule.name!r} produced an invalid model: {first}") from None


_INVALID = (SurgeryError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def _checked(model: onnx.ModelProto) -> onnx.ModelProto:
    """The shape-inferred model, after the full checker accepts it."""
    inferred = load_model(model)
    check_model_fully(inferred)
    return inferred


def _feed_fits(model: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> bool:
    """Whether every static input dim of `model` matches the arrays in `feed`."""
    initializers = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in initializers or vi.name not in feed:
            continue
        dims = vi.type.tensor_type.shape.dim
        shape = feed[vi.name].shape
        if len(dims) != len(shape):
            return False
        if any(d.dim_value > 0 and d.dim_value != s for d, s in zip(dims, shape, strict=True)):
            return False
    return True


def _fixed_inputs(matches: list[Match]) -> dict[str, np.ndarray]:
    """Inputs a rule fixed to one value (inline-if-branch's condition): the parent is
    verified with them so fed, the child no longer has them."""
    return {k: v for m in matches for k, v in m.fixed_inputs.items()}


def _verify(
    rule: Rule,
    parent: onnx.ModelProto,
    child: onnx.ModelProto,
    reference: Reference | None,
    fixed: Mapping[str, np.ndarray] | None = None,
) -> tuple[Verification, Reference]:
    if fixed:
        drawn = reference.inputs if reference is not None else make_inputs(parent)
        ref = Reference.of(parent, {**drawn, **fixed})
    else:
        ref = reference or Reference.of(parent)
    if not _feed_fits(child, ref.inputs):
        # The rewrite fixed input shapes (e.g. fix-input-shapes): draw inputs the child accepts;
        # the parent, whose dims were dynamic, runs on the same arrays.
        ref = Reference.of(parent, make_inputs(child))
    outputs = run_model(ort_session(child, label=f"result of {rule.name}"), ref.inputs)
    compare = _comparer(rule)
    comparisons = []
    for name, expected in ref.outputs.items():
        if name not in outputs:
            if rule.changes_outputs:
                continue
            comparisons.append(
                OutputComparison(
                    name,
                    name,
                    "name",
                    expected.shape,
                    (),
                    str(expected.dtype),
                    "",
                    False,
                    message=f"output {name!r} disappeared",
                )
            )
            continue
        comparisons.append(compare(name, expected, outputs[name]))
    if rule.changes_outputs and not comparisons:
        comparisons = []
    passed = all(c.passed for c in comparisons)
    note = None
    if not passed and not rule.changes_outputs:
        through = _verify_by_stages(rule, parent, child, ref)
        if through is not None:
            comparisons, passed, note = through
    verification = Verification(passed, rule.exactness, rule.error_bound, comparisons, note)
    return verification, Reference(ref.inputs, outputs)


def _comparer(rule: Rule) -> Callable[[str, np.ndarray, np.ndarray], OutputComparison]:
    """Compares one array of the parent with the child's: exact rules to float rounding,
    approximate rules to their declared bound on the relative error."""
    exact = rule.exactness == "exact"

    def compare(name: str, expected: np.ndarray, got: np.ndarray) -> OutputComparison:
        cmp = compare_arrays(expected, got, exact=exact, name=name)
        if not exact and cmp.max_rel is not None and cmp.shape_a == cmp.shape_b:
            cmp.passed = cmp.max_rel <= rule.error_bound
        return cmp

    return compare


def _verify_by_stages(
    rule: Rule,
    parent: onnx.ModelProto,
    child: onnx.ModelProto,
    ref: Reference,
) -> tuple[list[OutputComparison], bool, str] | None:
    """Outputs behind a TopK/ArgMax/NMS: compare stage by stage, each stage fed the parent's
    values (see `surgery.rules.selection`); None when the model has no such stages."""
    comparisons = compare_by_stages(parent, child, ref.inputs, ref.outputs, _comparer(rule))
    if comparisons is None:
        return None
    crossing = len(comparisons) - len(ref.outputs)
    note = (
        "the outputs follow a selection (TopK/ArgMax/NMS …) whose tie order float rounding "
        f"flips, so the model was compared stage by stage: {crossing} tensor(s) entering a "
        "later stage, each stage fed the original's values"
    )
    return comparisons, all(c.passed for c in comparisons), note
