"""Pydantic models at the MCP edge: argument types and structured results.

They exist so clients get JSON schemas for every tool and `structuredContent` they can rely on.
Core results (`to_dict()` of surgery objects) are mapped into these, trimmed for an agent's
context window: lists are paged or capped, and counts always say how much was left out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# --------------------------------------------------------------------------- arguments

ModelName = Annotated[
    str,
    Field(
        description="Model name in the workspace, as returned by open_model.",
        min_length=1,
        max_length=64,
    ),
]
VersionArg = Annotated[
    str | int,
    Field(description="Version of the model: 'latest', 'v3' or 3."),
]
TargetArg = Annotated[
    str | None,
    Field(
        description="Target profile (mlsoc, modalix, rk3588; see list_targets). "
        "Omitted: the server's default target."
    ),
]
LimitArg = Annotated[int, Field(ge=1, le=500, description="Most items to return.")]
OffsetArg = Annotated[int, Field(ge=0, description="Items to skip (for paging).")]
PathArg = Annotated[
    str,
    Field(
        description="File path under one of the server's allowed roots (relative paths start "
        "at the first root).",
        min_length=1,
        max_length=4096,
    ),
]


class Out(BaseModel):
    """Base for results: extra keys forbidden so the published schema is the whole truth."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- shared pieces


class Page(Out):
    total: int = Field(description="How many items exist in all.")
    offset: int
    returned: int
    next_offset: int | None = Field(description="Offset of the next page; null when done.")

    @classmethod
    def of(cls, total: int, offset: int, returned: int) -> Page:
        nxt = offset + returned
        return cls(
            total=total,
            offset=offset,
            returned=returned,
            next_offset=nxt if nxt < total else None,
        )


class Tensor(Out):
    name: str
    dtype: str | None = None
    shape: list[int | str | None] | None = Field(
        default=None, description="Dimensions; strings are symbolic, null is unknown."
    )


class VersionRef(Out):
    model: str
    version: str = Field(description="Version id, e.g. 'v3'.")


class VerifyBrief(Out):
    """Numerical comparison of a new version with the version it was made from."""

    passed: bool
    mode: str = Field(description="'exact' (float rounding only), 'approximate' or 'tolerance'.")
    worst_max_abs: float | None = None
    worst_max_rel: float | None = None
    reference: str | None = Field(
        default=None, description="What the new version was compared with."
    )
    note: str | None = Field(
        default=None,
        description="Set when the outputs follow a TopK/ArgMax/NMS and the versions were "
        "compared stage by stage (float rounding flips a selection's tie order).",
    )


class CoverageBrief(Out):
    target: str
    mla_segments: int = Field(description="MLA segments = .elf files a compile would produce.")
    single_elf: bool
    blockers: int = Field(description="Nodes kept off the MLA (excluding foldable constants).")
    mla_mac_fraction: float


# --------------------------------------------------------------------------- models


class SummaryOut(Out):
    model: str
    version: str
    graph_name: str
    opsets: dict[str, int]
    producer: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    nodes: int
    op_histogram: dict[str, int] = Field(description="Most frequent op types (top N).")
    other_op_types: int = Field(description="Op types left out of op_histogram.")
    parameters: int
    parameter_bytes: int
    dynamic_dims: dict[str, Any] = Field(description="Inputs with symbolic or unknown dims.")
    custom_domains: list[str]


class OpenModelOut(Out):
    model: str = Field(description="Workspace name to pass to every other tool.")
    version: str
    created: bool = Field(description="False when the file was already the latest version.")
    source: str
    summary: SummaryOut


class NodeOut(Out):
    model: str
    version: str
    node: dict[str, Any] = Field(
        description="name, op_type, attributes, inputs (shape, dtype, producer, small constant "
        "values), outputs (consumers), producers, consumers."
    )
    neighbourhood: list[dict[str, Any]] = Field(
        default_factory=list, description="Nodes within `hops` edges (when hops > 0)."
    )
    neighbourhood_truncated: bool = False


class NodeBrief(Out):
    name: str
    op_type: str
    outputs: list[Tensor]


class FindNodesOut(Out):
    model: str
    version: str
    page: Page
    nodes: list[NodeBrief]


class ValidationProblem(Out):
    code: str
    message: str
    hint: str | None = None


class ValidateOut(Out):
    valid: bool
    source: str
    problems: list[ValidationProblem]
    nodes: int | None = None
    opset: int | None = None


# --------------------------------------------------------------------------- coverage


class SegmentBrief(Out):
    name: str
    node_count: int
    inputs: list[str]
    outputs: list[str]
    macs: int


class BlockerGroup(Out):
    code: str
    reason: str
    count: int
    op_types: list[str]
    nodes: list[str] = Field(description="Up to `group_nodes` node names of this group.")
    suggested_rules: list[str] = Field(
        description="Rules with a match that removes a blocker of this group (apply_rule them)."
    )


class Blocker(Out):
    node: str
    op_type: str
    processor: str
    reasons: list[str]
    suggested_rules: list[str]


class CheckOut(Out):
    model: str
    version: str
    target: str
    nodes_total: int
    processors: dict[str, int]
    foldable_nodes: int
    mla_segments: int
    single_elf: bool
    macs_total: int
    mla_mac_fraction: float
    macs_unknown_nodes: int = Field(
        default=0,
        description="Matrix ops whose MACs are unknown (dynamic shapes); the MAC share leaves "
        "them out.",
    )
    dynamic_inputs: dict[str, Any]
    segments: list[SegmentBrief]
    blocker_groups: list[BlockerGroup]
    blockers_page: Page
    blockers: list[Blocker]


class TargetBrief(Out):
    name: str
    title: str
    mla_precisions: list[str]
    mla_ops: int
    resource: str


class TargetsOut(Out):
    targets: list[TargetBrief]
    default: str


class ExplainOpOut(Out):
    target: str
    op: str
    in_table: bool
    on_mla: bool
    note: str | None
    placements: list[dict[str, Any]] = Field(
        description="Per processor: precisions and constraints (each with its rule text)."
    )


# --------------------------------------------------------------------------- rules


class RuleInfo(Out):
    name: str
    summary: str
    category: str
    exactness: Literal["exact", "approximate"]
    error_bound: float | None
    changes_outputs: bool
    auto: bool = Field(description="Whether fix_model may pick the rule by itself.")
    params: dict[str, Any] | None = Field(
        default=None, description="JSON schema of each parameter (with detail or name)."
    )
    example: str | None = Field(default=None, description="A CLI example (with detail or name).")
    doc: str | None = Field(
        default=None, description="What the rule matches and does (with detail or name)."
    )


class RulesOut(Out):
    rules: list[RuleInfo]


class RuleMatchBrief(Out):
    rule: str
    category: str
    exactness: str
    matches: int
    blockers_removed: int = Field(description="Current blockers the rule's matches address.")
    nodes: list[str] = Field(description="Up to 20 nodes the rule would change.")
    reasons: list[str] = Field(description="Up to 5 match reasons.")


class SuggestOut(Out):
    model: str
    version: str
    target: str
    mla_segments: int
    single_elf: bool
    blocker_groups: list[BlockerGroup]
    rules: list[RuleMatchBrief] = Field(
        description="Rules that apply now, most blockers removed first (cleanup rules first)."
    )
    unaddressed_blockers: int = Field(description="Blockers no rule currently matches.")
    next_step: str
    notes: list[str] = Field(
        default_factory=list, description="E.g. that a quantized model is rewritten as float."
    )


# --------------------------------------------------------------------------- edits


class EditOut(Out):
    """What every editing tool returns: the new version and what it did to the model."""

    model: str
    version: str = Field(description="The new version id (unchanged when nothing was edited).")
    parent: str | None
    action: str
    changed: bool
    nodes_added: list[str] = Field(description="Up to 50 names.")
    nodes_added_count: int
    nodes_removed: list[str] = Field(description="Up to 50 names.")
    nodes_removed_count: int
    verify: VerifyBrief | None
    coverage: CoverageBrief = Field(description="Coverage of the new version.")
    mla_segments_before: int
    notes: list[str] = Field(default_factory=list)


class FixStep(Out):
    step: int
    rule: str
    matches: int
    segments_before: int
    segments_after: int
    blockers_before: int
    blockers_after: int
    pinned_after: int = Field(
        0,
        description="Blockers after the step that are on the host only by a pin (a placement "
        "step such as output-concat-to-host adds them on purpose).",
    )
    macs_unknown_nodes_before: int = Field(
        0,
        description="Matrix ops of unknown shape before the step: while above 0, the segment "
        "count is that of the model as it is, not as compiled (shapes wait for folding).",
    )
    macs_unknown_nodes_after: int = 0
    verify_passed: bool
    max_abs: float | None


class FixOut(EditOut):
    steps: list[FixStep]
    rejected: list[dict[str, str]]
    remaining_blocker_groups: list[BlockerGroup]


# --------------------------------------------------------------------------- verify


class OutputMetrics(Out):
    name: str
    name_b: str
    passed: bool
    shape_a: list[int]
    shape_b: list[int]
    max_abs: float | str | None = None
    max_rel: float | str | None = None
    cosine: float | str | None = None
    sqnr_db: float | str | None = None
    mismatches: int | None = None
    message: str = ""


class VerifyOut(Out):
    passed: bool
    reference: VersionRef
    candidate: VersionRef
    mode: str
    atol: float
    rtol: float
    samples: int
    worst: dict[str, float | str | None]
    failed_outputs: list[str]
    outputs: list[OutputMetrics] = Field(description="Up to 20 outputs.")
    notes: list[str]


# --------------------------------------------------------------------------- versions


class VersionOut(Out):
    version: str
    parent: str | None
    action: str
    created: str
    params: dict[str, Any] = Field(description="Action parameters (long node lists cut to 20).")
    verify: VerifyBrief | None
    coverage: dict[str, Any] | None
    note: str = ""


class HistoryOut(Out):
    model: str
    latest: str
    page: Page
    versions: list[VersionOut] = Field(description="Newest first.")


class DiffOut(Out):
    model: str
    a: str
    b: str
    identical: bool
    summary: str
    nodes_added: list[dict[str, Any]]
    nodes_removed: list[dict[str, Any]]
    nodes_changed: list[dict[str, Any]]
    counts: dict[str, int] = Field(description="Full counts of every list, before the limit.")
    other_changes: dict[str, list[str]] = Field(
        description="Initializers and graph inputs/outputs added, removed or changed."
    )


class ExportOut(Out):
    model: str
    version: str
    path: str
    bytes: int
    sha256: str
    external_data: bool


# --------------------------------------------------------------------------- pipeline


class QuantPartMetrics(Out):
    """One part of an output that concatenates tensors (a detector's boxes, its scores)."""

    sqnr_db: float | str | None = Field(description="Over all held-out samples together.")
    cosine: float | str | None = Field(description="Over all held-out samples together.")


class QuantOutputMetrics(Out):
    """One output of the QDQ model against the float model on the held-out samples."""

    name: str
    cosine: float | str | None = Field(description="Lowest over the held-out samples.")
    sqnr_db: float | str | None = Field(description="Lowest over the held-out samples.")
    max_abs: float | str | None = Field(description="Largest over the held-out samples.")
    parts: dict[str, QuantPartMetrics] = Field(
        default_factory=dict,
        description="An output that concatenates tensors, by the tensor each part comes from: "
        "one part can collapse (scores quantized to 0) while the whole looks fine.",
    )


class QuantizeOut(Out):
    model: str
    version: str = Field(description="The new version holding the QDQ model.")
    parent: str = Field(description="The float version that was quantized.")
    target: str
    method: str = Field(description="Calibration method actually used.")
    activation_scheme: str
    weight_scheme: str
    requantization_mode: str
    calibration_samples: int = Field(description="Samples the ranges were calibrated on.")
    holdout_samples: int = Field(
        description="Samples kept out of calibration and used only for the metrics below."
    )
    holdout_is_calibration: bool = Field(
        description="True when there were too few samples to hold any out: the metrics are "
        "then measured on calibration data and are optimistic."
    )
    quantized_nodes: int
    unquantized_nodes: list[str] = Field(description="Nodes left in float (up to 50).")
    hybrid_raised: list[str] = Field(
        default_factory=list,
        description="Layers auto hybrid raised to int16/bf16 (up to 50).",
    )
    hybrid_converged: bool | None = Field(
        default=None,
        description="Auto hybrid reached its goal (target_sqnr_db on every output, or no layer "
        "left under the auto_hybrid cosine); null without auto hybrid.",
    )
    outputs: list[QuantOutputMetrics] = Field(description="Up to 20 outputs.")
    worst_sqnr_db: float | str | None
    worst_cosine: float | str | None
    coverage: CoverageBrief = Field(description="Coverage of the QDQ version.")
    notes: list[str] = Field(default_factory=list)


class CompiledSegment(Out):
    name: str
    layers: int
    peak_bytes: int = Field(description="Peak arena use of the memory plan.")
    lower_bound_bytes: int = Field(description="No plan can use less (largest live set).")
    arena_capacity_bytes: int
    spilled_tensors: int
    cycles: int = Field(description="Static-schedule cycles.")
    stall_aware_cycles: int = Field(description="Cycles with the DRAM-stall cost model.")
    macs: int


class CompileOut(Out):
    model: str
    version: str
    archive: str = Field(description="Path of the written <name>_mpk.tar.gz.")
    target: str
    elf_files: list[str]
    elf_count: int
    check_mla_segments: int = Field(
        description="MLA segments check_model finds in the compiled version's graph."
    )
    elf_count_matches_check: bool = Field(
        description="True when the archive holds exactly one .elf per MLA segment check found."
    )
    single_elf: bool
    segments: list[CompiledSegment]
    stages: list[dict[str, str]] = Field(description="Pipeline stages: name, processor, kernel.")
    desired_batch_size: int
    actual_batch_size: int
    total_cycles: int
    compile_seconds: float
    notes: list[str] = Field(default_factory=list)
    default_mla: bool = Field(
        default=False,
        description="The target's profile gives no MLA geometry (rk3588): the program is laid "
        "out and its cycles modelled for the default virtual MLA; placement and segments are "
        "the target's.",
    )


class ArchiveTensor(Out):
    name: str
    shape: list[int]
    dtype: str | None = None
    layout: str | None = None


class ArchivePlugin(Out):
    name: str
    sequence: int
    processor: str
    kernel: str | None
    executable: str | None
    inputs: list[str]
    outputs: list[str]
    static_cycles: int | None = None
    stall_aware_cycles: int | None = None
    peak_bytes: int | None = None
    lower_bound_bytes: int | None = None
    instructions: int | None = Field(
        default=None, description="MLA program length (the ELF was decoded, its CRCs checked)."
    )


class LayerCycles(Out):
    index: int = Field(description="Layer index in pipeline order.")
    name: str
    start_cycle: int
    end_cycle: int
    cycles: int


class InspectArchiveOut(Out):
    archive: str
    name: str
    target: str | None
    model_path: str | None = Field(description="The QDQ model the archive was compiled from.")
    model_checksum: str | None
    custom_string: str
    desired_batch_size: int
    actual_batch_size: int
    elf_files: list[str]
    elf_count: int
    files: int = Field(description="Members of the archive.")
    inputs: list[ArchiveTensor]
    outputs: list[ArchiveTensor]
    plugins: list[ArchivePlugin] = Field(description="The pipeline, in order.")
    layers_page: Page
    layers: list[LayerCycles] = Field(description="MLA layers, most cycles first (paged).")
    notes: list[str]


class RunOutputSummary(Out):
    name: str
    shape: list[int]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    bit_exact: bool | None = Field(
        default=None,
        description="Equal to the integer reference executor (null when not compared).",
    )
    max_abs_diff_vs_reference: float | None = None


class RunStage(Out):
    name: str
    processor: str
    kernel: str
    invocations: int
    static_cycles: int
    stall_aware_cycles: int
    latency_us_per_frame: float
    estimate: str


class RunArchiveOut(Out):
    archive: str
    inputs: str = Field(description="Where the inputs came from (.npz path or 'random seed N').")
    frames: int
    actual_batch_size: int
    outputs: list[RunOutputSummary]
    compared_with_reference: bool
    reference_model: str | None = Field(
        default=None, description="The QDQ model the integer reference ran (when compared)."
    )
    bit_exact: bool | None = Field(
        default=None, description="All outputs equal the reference (null when not compared)."
    )
    mla_bit_exact: bool | None = Field(
        default=None,
        description="Every MLA stage's outputs equal the reference's same tensors (the "
        "compiler and emulator claim; null when not compared).",
    )
    reference_note: str | None = Field(
        default=None,
        description="Why outputs differ although every MLA stage is exact (float host stages).",
    )
    latency_us_per_frame: float = Field(
        description="Modelled device time per frame: MLA programs and built-in CVU kernels."
    )
    host_measured_us_per_frame: float = Field(
        description="ONNX host stages' run time per frame measured on this machine (x86 ONNX "
        "Runtime or the reference executor), not a device estimate; not in latency_us_per_frame."
    )
    mla_static_cycles: int
    wall_seconds: float
    stages: list[RunStage]
    notes: list[str] = Field(
        default_factory=list,
        description="What to know of the run: an input of another dtype is cast, an output "
        "that holds one value only (the inputs are unlike the calibration data).",
    )


class LayerErrorOut(Out):
    """One quantized activation: `entire` = QDQ model run from the input (errors accumulate),
    `single` = this layer alone fed float inputs (its own error: what mixed precision fixes)."""

    layer: str
    tensor: str
    op_type: str
    node: str | None
    entire: dict[str, float | None] = Field(description="cosine, cosine_min, euclidean, sqnr_db.")
    single: dict[str, float | None] = Field(description="cosine, cosine_min, euclidean, sqnr_db.")
    entire_parts: dict[str, dict[str, float | None]] = Field(
        default_factory=dict,
        description="For Concat outputs: the entire error of each input slice (a collapsed score "
        "slice hides in the whole-tensor cosine).",
    )
    single_parts: dict[str, dict[str, float | None]] = Field(
        default_factory=dict,
        description="For Concat outputs: the single error of each input slice.",
    )


class AnalyzeQuantizationOut(Out):
    model: str
    version: str = Field(description="The QDQ version analysed.")
    float_version: str = Field(description="The float version it was compared with.")
    samples: int
    outputs: dict[str, dict[str, float | None]] = Field(
        description="Model outputs vs float (null SQNR = exact)."
    )
    layers_page: Page
    layers: list[LayerErrorOut] = Field(description="Worst single-layer cosine first (paged).")
    skipped: int = Field(description="Quantized tensors with no float tensor of the same name.")
    preprocessing: dict[str, Any] = Field(
        description="How the samples were read (mean, std, bgr, input_shapes)."
    )
