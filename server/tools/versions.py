"""Tools over the workspace's immutable versions: history, diff, revert, verify, export."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

from server.convert import cap, edit_fields, page, version_out
from server.errors import FileExistsSurgeryError
from server.models import (
    DiffOut,
    EditOut,
    ExportOut,
    HistoryOut,
    LimitArg,
    ModelName,
    OffsetArg,
    OutputMetrics,
    PathArg,
    TargetArg,
    VerifyOut,
    VersionArg,
    VersionRef,
)
from server.state import ServerState
from server.tools._base import register_tool
from surgery.check import check_model as core_check_model
from surgery.errors import VerifyError
from surgery.model import PROTOBUF_LIMIT, model_nbytes, save_model
from surgery.verify import verify_models as core_verify_models
from surgery.workspace import file_sha256

MAX_OUTPUTS = 20


def register(mcp: MCPServer, state: ServerState) -> None:
    ws = state.workspace

    @register_tool(mcp, title="Version history", read_only=True, idempotent=True)
    def history(model: ModelName, limit: LimitArg = 20, offset: OffsetArg = 0) -> HistoryOut:
        """Every version of a model, newest first: the action that made it (rule, fix,
        revert, import), its parent, its verification and its coverage."""
        versions = ws.versions(model)[::-1]
        chunk, pg = page(versions, offset, limit)
        return HistoryOut(
            model=model,
            latest=versions[0].id,
            page=pg,
            versions=[version_out(v) for v in chunk],
        )

    @register_tool(mcp, title="Revert to a version", read_only=False, idempotent=False)
    def revert(model: ModelName, version: VersionArg, target: TargetArg = None) -> EditOut:
        """Make a new latest version identical to an older one (history is never rewritten;
        the versions in between stay available)."""
        previous = ws.latest(model)
        new = ws.revert(model, version)
        delta = ws.diff(model, previous.version, new.version)
        _, proto = state.read_only(model, new.version)
        cov = core_check_model(proto, target or state.default_target)
        before = (previous.coverage or {}).get("mla_segments")
        return EditOut(
            **edit_fields(
                previous,
                new,
                added=[n.key for n in delta.nodes_added],
                removed=[n.key for n in delta.nodes_removed],
                verify=None,
                coverage=cov,
                segments_before=before if isinstance(before, int) else cov.mla_segments,
                notes=[f"byte-identical copy of {new.params.get('to')}, verified when it was made"],
            )
        )

    @register_tool(mcp, title="Diff two versions", read_only=True, idempotent=True)
    def diff_versions(
        model: ModelName,
        a: VersionArg,
        b: VersionArg = "latest",
        limit: LimitArg = 50,
    ) -> DiffOut:
        """Nodes added, removed and changed between two versions (plus initializers and
        graph inputs/outputs), each list cut to `limit` with full counts."""
        d = ws.diff(model, a, b).to_dict()
        lists = ("nodes_added", "nodes_removed", "nodes_changed")
        others = {
            k: v
            for k, v in d.items()
            if k.startswith(("initializers_", "inputs_", "outputs_")) and v
        }
        return DiffOut(
            model=model,
            a=d["a"],
            b=d["b"],
            identical=d["identical"],
            summary=d["summary"],
            nodes_added=cap(d["nodes_added"], limit),
            nodes_removed=cap(d["nodes_removed"], limit),
            nodes_changed=cap(d["nodes_changed"], limit),
            counts={k: len(d[k]) for k in lists} | {k: len(v) for k, v in others.items()},
            other_changes={k: cap(v, limit) for k, v in others.items()},
        )

    @register_tool(mcp, title="Verify two versions", read_only=True, idempotent=True)
    def verify_models(
        model: ModelName,
        version: VersionArg = "latest",
        reference_version: Annotated[
            str | int | None,
            Field(description="Version to compare against (default: the version's parent)."),
        ] = None,
        reference_model: Annotated[
            str | None, Field(description="Another workspace model as the reference.")
        ] = None,
        exact: Annotated[
            bool, Field(description="Float rounding only (for data-movement rewrites).")
        ] = False,
        atol: Annotated[
            float, Field(ge=0, allow_inf_nan=False, description="Absolute tolerance per element.")
        ] = 1e-4,
        rtol: Annotated[
            float, Field(ge=0, allow_inf_nan=False, description="Relative tolerance per element.")
        ] = 1e-3,
        samples: Annotated[
            int, Field(ge=1, le=16, description="Random input draws (worst case is reported).")
        ] = 1,
        seed: Annotated[int, Field(ge=0, description="Seed of the first random draw.")] = 0,
    ) -> VerifyOut:
        """Run the reference and the candidate with ONNX Runtime on the same seeded inputs
        and compare every output (max abs/rel error, cosine, SQNR)."""
        cand = ws.info(model, version)
        ref_name = reference_model or model
        if reference_version is None and reference_model is None:
            if cand.parent is None:
                raise VerifyError(
                    f"{model} {cand.id} has no parent to compare with",
                    hint="pass reference_version (e.g. 'v0') or reference_model",
                )
            reference_version = cand.parent
        ref = ws.info(ref_name, "latest" if reference_version is None else reference_version)
        result = core_verify_models(
            ref.path, cand.path, atol=atol, rtol=rtol, exact=exact, samples=samples, seed=seed
        ).to_dict()
        return VerifyOut(
            passed=result["passed"],
            reference=VersionRef(model=ref.name, version=ref.id),
            candidate=VersionRef(model=cand.name, version=cand.id),
            mode=result["mode"],
            atol=result["atol"],
            rtol=result["rtol"],
            samples=result["samples"],
            worst=result["worst"],
            failed_outputs=result["failed_outputs"],
            outputs=[
                OutputMetrics(
                    **{k: o.get(k) for k in OutputMetrics.model_fields if k in o},
                )
                for o in result["outputs"][:MAX_OUTPUTS]
            ],
            notes=result["notes"],
        )

    @register_tool(
        mcp, title="Export a version to a file", read_only=False, idempotent=True, destructive=True
    )
    def export_model(
        model: ModelName,
        path: PathArg,
        version: VersionArg = "latest",
        overwrite: Annotated[
            bool, Field(description="Replace an existing file (otherwise refused).")
        ] = False,
    ) -> ExportOut:
        """Write a version to an .onnx file under an allowed root (outside the workspace).
        An existing file is only replaced with overwrite=true."""
        dest = state.output_path(path)
        if dest.exists() and not overwrite:
            raise FileExistsSurgeryError(
                f"{dest} already exists", hint="pass overwrite=true or choose another path"
            )
        info = ws.info(model, version)
        proto = ws.load(model, info.version)
        external = model_nbytes(proto) > PROTOBUF_LIMIT - 64 * 2**20
        save_model(proto, dest, external_data=external)
        return ExportOut(
            model=info.name,
            version=info.id,
            path=str(dest),
            bytes=dest.stat().st_size,
            sha256=file_sha256(dest),
            external_data=external,
        )
