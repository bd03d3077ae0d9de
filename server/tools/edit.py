"""Structural tools over `surgery.edit` and `surgery.split`: free-form edits, split, merge.

Edits change numbers on purpose, so their verification is reported, not enforced: the agent
reads it and decides. A split that keeps the model's inputs is verified exactly against the
parent's intermediate tensors; other splits and merges change the interface and say so.
"""

from __future__ import annotations

from typing import Annotated, Any

import onnx
from mcp.server.mcpserver import MCPServer
from pydantic import Field

from server.convert import edit_fields
from server.models import EditOut, ModelName, TargetArg, VersionArg
from server.state import ServerState
from server.tools._base import register_tool
from surgery.check import check_model as core_check_model
from surgery.edit import EditOp, ReplaceInitializer, add_output, apply_edits
from surgery.errors import SurgeryError, VerifyError
from surgery.session import coverage_summary
from surgery.split import merge_models as core_merge_models
from surgery.split import split_model as core_split_model
from surgery.verify import verify_models
from surgery.workspace import VersionInfo, validate_name

EditList = Annotated[
    list[EditOp],
    Field(
        min_length=1,
        max_length=200,
        description="Edits applied in order, each {'op': ..., ...}: remove_node, bypass_node, "
        "replace_op, set_attributes, insert_node_before, insert_node_after, rename_tensor, "
        "set_input_shape, add_output, remove_output, replace_initializer.",
    ),
]
Tensors = Annotated[list[str] | None, Field(description="Tensor names.")]
IntoArg = Annotated[
    str | None,
    Field(
        description="Store the result as a new workspace model of this name (default: a new "
        "version of the model edited: split_model's model, merge_models' model_a)."
    ),
]


def _graph_inputs(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _verify(
    reference: onnx.ModelProto, candidate: onnx.ModelProto, exact: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    """Compare outputs of the same name; a model pair without common outputs gets a note."""
    try:
        return verify_models(reference, candidate, exact=exact).to_dict(), []
    except VerifyError as exc:
        return None, [f"not verified: {exc.message}"]


def register(mcp: MCPServer, state: ServerState) -> None:
    ws = state.workspace

    def store(
        parent: VersionInfo,
        into: str | None,
        new: onnx.ModelProto,
        action: str,
        params: dict[str, Any],
        verify: dict[str, Any] | None,
        target: str | None,
        notes: list[str],
        parent_model: onnx.ModelProto,
    ) -> EditOut:
        tgt = target or state.default_target
        before = core_check_model(parent_model, tgt)
        after = core_check_model(new, tgt)
        record = dict(action=action, params=params, verify=verify, coverage=coverage_summary(after))
        if into:
            validate_name(into)
            info = ws.import_model(new, into, note=f"{action} of {parent.name} {parent.id}")
        else:
            info = ws.add_version(parent.name, new, parent=parent.version, **record)
        old_names = {p.name for p in before.placements}
        new_names = {p.name for p in after.placements}
        return EditOut(
            **edit_fields(
                parent,
                info,
                added=sorted(new_names - old_names),
                removed=sorted(old_names - new_names),
                verify=verify,
                coverage=after,
                segments_before=before.mla_segments,
                notes=notes + ([f"stored as new model {into!r}"] if into else []),
                action=action,
            )
        )

    @register_tool(mcp, title="Edit the graph", read_only=False, idempotent=False)
    def edit_graph(
        model: ModelName,
        ops: EditList,
        version: VersionArg = "latest",
        target: TargetArg = None,
    ) -> EditOut:
        """Low-level edits for what no rule covers (remove or bypass a node, change an op or
        its attributes, insert a node, rename a tensor, set an input shape, add/remove an
        output, replace an initializer). All edits apply or none do; the result must pass the
        ONNX checker. Outputs are compared with the parent and reported, not enforced."""
        parent, proto = state.editable(model, version)
        for op in ops:
            if isinstance(op, ReplaceInitializer) and op.npy is not None:
                op.npy = str(state.input_path(op.npy))  # .npy files obey the allowed roots too
        new = apply_edits(proto, ops)
        verify, notes = _verify(proto, new, exact=False)
        if verify is not None and not verify["passed"]:
            notes.append("outputs changed beyond tolerance (expected for math-changing edits)")
        params = {"ops": [op.model_dump(exclude_defaults=True) for op in ops]}
        return store(parent, None, new, "edit", params, verify, target, notes, proto)

    @register_tool(mcp, title="Split a model", read_only=False, idempotent=False)
    def split_model(
        model: ModelName,
        inputs: Tensors = None,
        outputs: Tensors = None,
        version: VersionArg = "latest",
        into: IntoArg = None,
        target: TargetArg = None,
    ) -> EditOut:
        """Keep only the subgraph that computes `outputs` from `inputs` (defaults: the model's
        own inputs/outputs) — e.g. cut post-processing off at the tensors that feed it."""
        if not inputs and not outputs:
            raise SurgeryError(
                "give inputs and/or outputs (tensor names where the part starts/ends)"
            )
        parent, proto = state.editable(model, version)
        ins = inputs or _graph_inputs(proto)
        outs = outputs or [o.name for o in proto.graph.output]
        part = core_split_model(proto, ins, outs)
        notes: list[str] = []
        verify = None
        if set(ins) == set(_graph_inputs(proto)):
            reference = proto
            for tensor in outs:
                if tensor not in {o.name for o in reference.graph.output}:
                    reference = add_output(reference, tensor)
            verify, notes = _verify(reference, part, exact=True)
        else:
            notes.append(
                "not verified: the part starts at intermediate tensors; merge it back "
                "with merge_models and verify against the original"
            )
        params = {"inputs": ins, "outputs": outs}
        return store(parent, into, part, "split", params, verify, target, notes, proto)

    @register_tool(mcp, title="Merge two models", read_only=False, idempotent=False)
    def merge_models(
        model_a: ModelName,
        model_b: ModelName,
        io_map: Annotated[
            dict[str, str],
            Field(description="Outputs of A feeding inputs of B: {A_OUT: B_IN}.", min_length=1),
        ],
        version_a: VersionArg = "latest",
        version_b: VersionArg = "latest",
        keep_outputs: Tensors = None,
        into: IntoArg = None,
        target: TargetArg = None,
    ) -> EditOut:
        """Connect outputs of A to inputs of B as one model (e.g. put a split-off part back),
        stored as a new version of A unless `into` names a new model."""
        parent, a = state.editable(model_a, version_a)
        _, b = state.editable(model_b, version_b)
        merged = core_merge_models(a, b, io_map, keep_outputs=keep_outputs or ())
        notes = [
            "not verified: a merge changes the model's inputs/outputs; verify_models the "
            "result against the model it reassembles"
        ]
        info_b = state.info(model_b, version_b)
        params = {"b": f"{info_b.name} {info_b.id}", "io_map": io_map}
        return store(parent, into, merged, "merge", params, None, target, notes, a)
