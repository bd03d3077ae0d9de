"""Tools from a checked model to a run on the emulated NPU: quantize, compile, inspect, run.

Thin wrappers of `compiler.api` / `compiler.compile`, `compiler.archive` and
`compiler.runtime.pipeline`: the server adds only what an MCP client needs on top: paths
confined to the allowed roots, the QDQ model stored as a workspace version (so it has a history
and can be compiled by name), progress notifications, and results trimmed for a context window.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import anyio.from_thread
import numpy as np
from mcp.server.mcpserver import Context, MCPServer
from pydantic import Field

from server.convert import cap, coverage_brief, page
from server.models import (
    AnalyzeQuantizationOut,
    ArchivePlugin,
    ArchiveTensor,
    CompiledSegment,
    CompileOut,
    InspectArchiveOut,
    LayerCycles,
    LayerErrorOut,
    LimitArg,
    ModelName,
    OffsetArg,
    PathArg,
    QuantizeOut,
    QuantOutputMetrics,
    QuantPartMetrics,
    RunArchiveOut,
    RunOutputSummary,
    RunStage,
    TargetArg,
    VersionArg,
)
from server.paths import PathNotAllowedError, file_in_the_way
from server.state import ServerState
from server.tools._base import register_tool
from surgery.errors import SurgeryError

MAX_OUTPUTS = 20
NameArg = Annotated[
    str | None,
    Field(
        description="Archive name (<name>_mpk.tar.gz); default <model>_<version>.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
    ),
]


class InvalidArgumentError(SurgeryError):
    """An option the core rejected with a ValueError (unknown method, bad scheme …)."""

    code = "invalid_argument"


class ArchiveExistsError(SurgeryError):
    code = "file_exists"


def _finite(value: float | None) -> float | str | None:
    """JSON-safe number: infinities (exact SQNR) become 'inf' / '-inf'."""
    if value is None or math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"


def _stat(values: np.ndarray, fn: Any) -> float | None:
    return float(fn(values)) if values.size else None


def register(mcp: MCPServer, state: ServerState) -> None:
    ws = state.workspace

    def output_folder(raw: str) -> Path:
        """An allowed folder outside the workspace (created, with its missing parents)."""
        folder = state.input_path(raw)
        for protected in state.policy.protected:
            if folder == protected or folder.is_relative_to(protected):
                raise PathNotAllowedError(
                    f"refusing to write into {raw!r}: it is inside the workspace {protected}",
                    hint="choose an output folder outside the workspace folder",
                )
        if folder.exists() and not folder.is_dir():
            raise PathNotAllowedError(f"{raw!r} is a file; output_dir must be a folder")
        blocking = file_in_the_way(folder)
        if blocking is not None:
            raise PathNotAllowedError(f"cannot create {raw!r}: {blocking} is a file")
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def reference_path(archive: Any, model: str | None, version: VersionArg) -> Path:
        """The QDQ model for the bit-exact comparison: a workspace version when named, else
        the model_path the archive records, if the server may read it and it is unchanged."""
        from compiler.archive import check_compiled_from, checksum_of_digest

        if model is not None:
            info = ws.info(model, version)
            path = ws.checked_path(info)  # the file has the sha256 its record gives
            checksum = archive.manifest.get("model_checksum")
            if checksum_of_digest(info.sha256) != checksum:  # not it: name the one that is
                compiled = [
                    v.id for v in ws.versions(info.name) if checksum_of_digest(v.sha256) == checksum
                ]
                hint = f"pass reference_version={compiled[-1]!r}" if compiled else None
                check_compiled_from(archive.manifest, path, f"{info.name} {info.id}", hint)
            return path
        recorded = str(archive.manifest.get("model_path") or "")
        if not recorded or not Path(recorded).is_file():
            raise SurgeryError(
                f"the archive records model_path {recorded!r}, which is not a file",
                hint="pass the compiled QDQ version as reference_model (+ reference_version)",
            )
        path = Path(recorded).resolve()
        if not path.is_relative_to(ws.root.resolve()):
            path = state.input_path(recorded)  # refuses paths outside the allowed roots
        check_compiled_from(archive.manifest, path)
        return path

    @register_tool(mcp, title="Quantize a model", read_only=False, idempotent=False)
    async def quantize_model(
        ctx: Context,
        model: ModelName,
        calibration: Annotated[
            str,
            Field(
                description="Calibration data under an allowed root: a folder of .npy/.npz "
                "files or images, a dataset.txt, or one .npz/.npy file.",
                min_length=1,
                max_length=4096,
            ),
        ],
        version: VersionArg = "latest",
        target: TargetArg = None,
        method: Annotated[
            str | None,
            Field(
                description="Calibration method: mse (default), min_max, moving_average, "
                "entropy, percentile."
            ),
        ] = None,
        precision: Annotated[
            Literal["int8", "int16"],
            Field(description="int8 (A8W8) or int16 (A16W8 activations)."),
        ] = "int8",
        requantization_mode: Annotated[
            Literal["sima", "tflite"] | None,
            Field(
                description="How int32 accumulators are rescaled to int8: sima (shift-only) "
                "or tflite (multiplier and shift); default: the target's."
            ),
        ] = None,
        bias_correction: Annotated[
            bool,
            Field(description="Correct each layer's mean output shift caused by int8 weights."),
        ] = False,
        channel_equalization: Annotated[
            bool,
            Field(description="Equalize per-channel weight ranges across consecutive convs first."),
        ] = False,
        unquantized_nodes: Annotated[
            list[str] | None, Field(description="Nodes to keep in float.")
        ] = None,
        input_shapes: Annotated[
            dict[str, list[int]] | None,
            Field(description="Fix dynamic input dims, e.g. {'images': [1, 3, 640, 640]}."),
        ] = None,
        mean: Annotated[list[float] | None, Field(description="Image mean per channel.")] = None,
        std: Annotated[list[float] | None, Field(description="Image std per channel.")] = None,
        bgr: Annotated[
            bool, Field(description="Feed image channels as BGR (default RGB).")
        ] = False,
        limit: Annotated[int | None, Field(ge=1, description="Use only the first N.")] = None,
        holdout: Annotated[
            int,
            Field(
                ge=0,
                le=32,
                description="Samples kept out of calibration to measure SQNR/cosine vs float.",
            ),
        ] = 2,
        auto_hybrid: Annotated[
            bool,
            Field(
                description="Raise layers whose cosine to float falls under 0.98 to int16 "
                "(bf16 on modalix), iteratively (RKNN's auto hybrid)."
            ),
        ] = False,
        target_sqnr_db: Annotated[
            float | None,
            Field(
                gt=0,
                le=120,
                description="Raise the layers whose error hurts the outputs most until every "
                "output, and every part of a concatenated output (boxes ‖ scores), reaches "
                "this SQNR (dB) on the calibration samples. Slow on big models.",
            ),
        ] = None,
    ) -> QuantizeOut:
        """Calibrate on the data and store the QDQ model as a new version (the float version
        is kept), so compile_model can address it by name. The last `holdout` samples are not
        calibrated on: the QDQ and float models are compared on them, which is the honest
        estimate of quantization error. Reports progress per calibration sample."""
        from compiler.api import load_model
        from compiler.defines import default_quantization, int16_quantization
        from compiler.quantize import load_calibration_data
        from compiler.quantize.advice import hybrid_outcome, low_sqnr_advice
        from compiler.quantize.holdout import part_sqnrs, stacked_errors
        from surgery.check import check_model
        from surgery.session import coverage_summary
        from surgery.verify import compare_arrays

        parent = ws.info(model, version)
        source = state.input_path(calibration)
        tgt = target or state.default_target
        try:
            config = int16_quantization if precision == "int16" else default_quantization
            if method:
                config = config.with_calibration(method)
            if requantization_mode:
                config = config.with_requantization_mode(requantization_mode)
            if unquantized_nodes:
                config = config.with_unquantized_nodes(unquantized_nodes)
            config = config.with_bias_correction(bias_correction).with_channel_equalization(
                channel_equalization
            )
        except ValueError as exc:
            if isinstance(exc, SurgeryError):
                raise
            raise InvalidArgumentError(str(exc)) from None
        await ctx.report_progress(0, None, f"loading {parent.name} {parent.id} and {source.name}")

        def on_progress(done: int, total: int | None) -> None:
            every = max(1, (total or 0) // 20)
            if done % every == 0 or done == total:
                anyio.from_thread.run(
                    ctx.report_progress, done, total, f"calibration sample {done}/{total or '?'}"
                )

        def work() -> QuantizeOut:
            net = load_model(parent.path, input_shapes, target=tgt)
            data = load_calibration_data(
                source,
                net.model,
                input_shapes=input_shapes,
                mean=mean,
                std=std,
                bgr=bgr,
                limit=limit,
                layout=net.layout,
            )
            count = len(data)
            held_out = min(holdout, count - 1) if count > 1 else 0
            calib, held = copy.copy(data), copy.copy(data)
            calib.rows = data.rows[: count - held_out]
            held.rows = data.rows[count - held_out :] if held_out else data.rows[:1]
            quantized = net.quantize(
                calib,
                config,
                model_name=parent.name,
                progress=on_progress,
                auto_hybrid=auto_hybrid,
                target_sqnr_db=target_sqnr_db,
            )
            worst: dict[str, dict[str, float]] = {}
            floats: dict[str, list] = {}
            quants: dict[str, list] = {}
            for sample in held:
                reference, candidate = net.execute(sample), quantized.execute(sample)
                for name, ref in reference.items():
                    floats.setdefault(name, []).append(ref)
                    quants.setdefault(name, []).append(candidate[name])
                    cmp = compare_arrays(ref, candidate[name], name=name)
                    row = worst.setdefault(name, {"cosine": math.inf, "sqnr_db": math.inf})
                    row["max_abs"] = max(row.get("max_abs", 0.0), cmp.max_abs or 0.0)
                    for key in ("cosine", "sqnr_db"):
                        value = getattr(cmp, key)
                        if value is not None:
                            row[key] = min(row[key], value)
            errors = stacked_errors(floats, quants, net.model)
            coverage = check_model(quantized.qdq_model, tgt)
            report = quantized.report
            params = quantized.params
            metrics = [
                QuantOutputMetrics(
                    name=name,
                    cosine=_finite(row["cosine"]),
                    sqnr_db=_finite(row["sqnr_db"]),
                    max_abs=_finite(row["max_abs"]),
                    parts={
                        part: QuantPartMetrics(
                            sqnr_db=_finite(err["sqnr_db"]), cosine=_finite(err["cosine"])
                        )
                        for part, err in errors.get(name, {}).get("parts", {}).items()
                    },
                )
                for name, row in worst.items()
            ]
            worst_sqnr = min((row["sqnr_db"] for row in worst.values()), default=None)
            worst_cos = min((row["cosine"] for row in worst.values()), default=None)
            new = ws.add_version(
                parent.name,
                quantized.qdq_model,
                parent=parent.version,
                action="quantize",
                params={
                    "target": quantized.target,
                    "calibration": str(source),
                    "calibration_samples": count - held_out,
                    "holdout_samples": held_out,
                    "config": params.to_dict(),
                    "preprocessing": {
                        "mean": mean,
                        "std": std,
                        "bgr": bgr,
                        "input_shapes": input_shapes,
                    },
                    "holdout_worst_sqnr_db": _finite(worst_sqnr),
                    "holdout_worst_cosine": _finite(worst_cos),
                },
                coverage=coverage_summary(coverage),
            )
            unquantized = sorted(report.get("unquantized_nodes") or {})
            notes = list(report.get("notes") or [])
            hybrid = report.get("auto_hybrid") or {}
            raised = [r["layer"] for r in hybrid.get("raised", [])]
            outcome = hybrid_outcome(hybrid)
            notes += [outcome] if outcome else []
            if not held_out:
                notes.append(
                    "only one calibration sample: the metrics are measured on it (optimistic); "
                    "give more samples for a held-out estimate"
                )
            notes += low_sqnr_advice(
                {n: None if r["sqnr_db"] == math.inf else r["sqnr_db"] for n, r in worst.items()},
                raised=bool(raised) or params.activation_quantization_scheme.bits == 16,
                raise_layers="target_sqnr_db=30",
                raise_parts="auto_hybrid=0.98",
                analyze=f"analyze_quantization on {new.name} {new.id}",
                part_sqnr_db=part_sqnrs(errors),
            )
            return QuantizeOut(
                model=new.name,
                version=new.id,
                parent=parent.id,
                target=quantized.target,
                method=params.calibration_method.name,
                activation_scheme=params.activation_quantization_scheme.describe(),
                weight_scheme=params.weight_quantization_scheme.describe(),
                requantization_mode=params.requantization_mode.value,
                calibration_samples=count - held_out,
                holdout_samples=held_out,
                holdout_is_calibration=not held_out,
                quantized_nodes=int(report.get("quantized_nodes", 0)),
                unquantized_nodes=cap(unquantized),
                hybrid_raised=cap(raised),
                hybrid_converged=hybrid.get("converged") if hybrid else None,
                outputs=metrics[:MAX_OUTPUTS],
                worst_sqnr_db=_finite(worst_sqnr),
                worst_cosine=_finite(worst_cos),
                coverage=coverage_brief(coverage),
                notes=notes,
            )

        result = await anyio.to_thread.run_sync(work)
        await ctx.report_progress(
            1, 1, f"stored {result.model} {result.version} (worst SQNR {result.worst_sqnr_db} dB)"
        )
        return result

    @register_tool(mcp, title="Per-layer quantization error", read_only=True, idempotent=True)
    async def analyze_quantization(
        ctx: Context,
        model: ModelName,
        data: Annotated[
            str,
            Field(
                description="Samples under an allowed root (as for quantize_model's "
                "calibration; held-out samples give the honest picture).",
                min_length=1,
                max_length=4096,
            ),
        ],
        version: VersionArg = "latest",
        float_version: Annotated[
            str | int | None,
            Field(description="The float version to compare with (default: the parent)."),
        ] = None,
        samples: Annotated[int, Field(ge=1, le=256, description="Most samples to run.")] = 8,
        limit: LimitArg = 20,
        offset: OffsetArg = 0,
        input_shapes: Annotated[
            dict[str, list[int]] | None,
            Field(description="As for quantize_model (default: what it was quantized with)."),
        ] = None,
        mean: Annotated[
            list[float] | None,
            Field(description="Image mean per channel (default: what it was quantized with)."),
        ] = None,
        std: Annotated[
            list[float] | None,
            Field(description="Image std per channel (default: what it was quantized with)."),
        ] = None,
        bgr: Annotated[
            bool | None, Field(description="BGR images (default: what it was quantized with).")
        ] = None,
    ) -> AnalyzeQuantizationOut:
        """Where quantization error comes from: for every quantized activation, its error
        with upstream errors accumulated (entire) and on its own (single), worst first. Raise
        the precision of (or leave unquantized) the layers whose single error is bad; a layer
        bad only in entire is a victim of an upstream one."""
        from compiler.quantize import load_calibration_data
        from compiler.quantize.analysis import analyze_quantization_error

        qdq = ws.info(model, version)
        if float_version is None and qdq.parent is None:
            raise InvalidArgumentError(
                f"{model} {qdq.id} has no parent to compare with",
                hint="pass float_version (the version that was quantized)",
            )
        base = ws.info(model, qdq.parent if float_version is None else float_version)
        source = state.input_path(data)
        # Images must be read as calibration read them, or the error measured is not its own.
        recorded = qdq.params.get("preprocessing") or {}
        given = {"mean": mean, "std": std, "bgr": bgr, "input_shapes": input_shapes}
        prep = {k: v if v is not None else recorded.get(k) for k, v in given.items()}

        def on_progress(done: int, total: int | None) -> None:
            anyio.from_thread.run(ctx.report_progress, done, total, f"sample {done}/{total or '?'}")

        def work() -> Any:
            float_proto, qdq_proto = ws.load(model, base.version), ws.load(model, qdq.version)
            dataset = load_calibration_data(
                source,
                float_proto,
                limit=samples,
                input_shapes=prep["input_shapes"],
                mean=prep["mean"],
                std=prep["std"],
                bgr=bool(prep["bgr"]),
            )
            return analyze_quantization_error(
                float_proto, qdq_proto, dataset, limit=samples, progress=on_progress
            )

        result = (await anyio.to_thread.run_sync(work)).to_dict()
        chunk, pg = page(result["layers"], offset, limit)
        return AnalyzeQuantizationOut(
            model=qdq.name,
            version=qdq.id,
            float_version=base.id,
            samples=result["samples"],
            outputs=result["outputs"],
            layers_page=pg,
            layers=[LayerErrorOut(**row) for row in chunk],
            skipped=len(result["skipped"]),
            preprocessing=prep,
        )

    @register_tool(mcp, title="Compile to an archive", read_only=False, idempotent=False)
    async def compile_model(
        ctx: Context,
        model: ModelName,
        output_dir: Annotated[
            str,
            Field(
                description="Folder under an allowed root (not the workspace) for the archive; "
                "created if only its parent exists.",
                min_length=1,
                max_length=4096,
            ),
        ],
        version: VersionArg = "latest",
        target: TargetArg = None,
        name: NameArg = None,
        batch_size: Annotated[
            int,
            Field(
                ge=1,
                le=64,
                description="Frames per MLA call wanted; the largest that fits the arena is used.",
            ),
        ] = 1,
        compress: Annotated[bool, Field(description="zlib-compress each .elf's .rodata.")] = True,
        memory_plan_strategy: Annotated[
            Literal["BestFit", "GreedyBySize", "GreedyByLifetime", "SlowPeakGrowth"] | None,
            Field(description="How activations are packed into the arena (default BestFit)."),
        ] = None,
        compute_order: Annotated[
            Literal["WidthFirst", "DepthFirst"] | None,
            Field(description="Layer schedule order (default WidthFirst)."),
        ] = None,
        single_core_mode: Annotated[
            bool, Field(description="Use one quad (a quarter of the arena and MAC arrays).")
        ] = False,
        custom_string: Annotated[
            str | None, Field(max_length=1024, description="Stored in the archive and each .elf.")
        ] = None,
    ) -> CompileOut:
        """Compile a quantized (QDQ) version into <name>_mpk.tar.gz: one .elf per MLA
        segment. Reports per-segment peak arena vs its lower bound and cycles, and whether the
        .elf count equals the MLA segments check finds, which is the goal of the surgery.
        Never overwrites: an existing archive of that name is refused."""
        import onnx

        from compiler.archive import ARCHIVE_SUFFIX
        from compiler.compile import compile_model as core_compile
        from surgery.qdq import quantized_for

        info = ws.info(model, version)
        ws.checked_path(info)
        folder = output_folder(output_dir)
        archive_name = name or f"{info.name}_{info.id}"
        dest = folder / f"{archive_name}{ARCHIVE_SUFFIX}"
        if dest.exists():
            raise ArchiveExistsError(
                f"{dest} already exists; compile_model never overwrites",
                hint="pass another name or output_dir, or inspect_archive the existing one",
            )
        options: dict[str, Any] = {
            "batch_size": batch_size,
            "compress": compress,
            "single_core_mode": single_core_mode,
            "custom_string": custom_string,
        }
        if memory_plan_strategy:
            options["memory_plan_strategy"] = memory_plan_strategy
        if compute_order:
            options["compute_order"] = compute_order
        await ctx.report_progress(0, 2, f"lowering {info.name} {info.id}")
        # From the version's file, so the archive records its path and checksum and
        # run_archive can find the QDQ model for the bit-exact comparison.
        recorded = quantized_for(onnx.load(str(info.path), load_external_data=False))
        result = await anyio.to_thread.run_sync(
            lambda: core_compile(
                info.path,
                folder,
                target=target or recorded or state.default_target,
                model_name=archive_name,
                **options,
            )
        )
        d = result.to_dict()
        await ctx.report_progress(2, 2, f"wrote {result.archive.name}: {d['elf_count']} .elf")
        return CompileOut(
            model=info.name,
            version=info.id,
            archive=d["archive"],
            target=d["target"],
            elf_files=d["elf_files"],
            elf_count=d["elf_count"],
            check_mla_segments=d["mla_segments"],
            elf_count_matches_check=d["elf_count"] == d["mla_segments"],
            single_elf=d["elf_count"] == 1,
            segments=[
                CompiledSegment(**{k: s[k] for k in CompiledSegment.model_fields if k in s})
                for s in d["segments"]
            ],
            stages=d["stages"],
            desired_batch_size=d["desired_batch_size"],
            actual_batch_size=d["actual_batch_size"],
            total_cycles=d["total_cycles"],
            compile_seconds=d["compile_seconds"],
            notes=d["notes"],
            default_mla=d["default_mla"],
        )

    @register_tool(mcp, title="Inspect an archive", read_only=True, idempotent=True)
    def inspect_archive(
        archive: PathArg, limit: LimitArg = 20, offset: OffsetArg = 0
    ) -> InspectArchiveOut:
        """What a compiled archive holds: the pipeline of plugins (processor, kernel,
        executable, MLA cycles and arena), its .elf files, I/O tensors, and the MLA layers
        with the most cycles first (paged), to see where the time goes."""
        from compiler.archive import read_archive

        opened = read_archive(state.input_path(archive))
        s = opened.summary()
        layers = sorted(
            (
                LayerCycles(
                    index=int(k),
                    name=str(v["name"]),
                    start_cycle=int(v["start_cycle"]),
                    end_cycle=int(v["end_cycle"]),
                    cycles=int(v["end_cycle"]) - int(v["start_cycle"]),
                )
                for k, v in opened.stats.items()
            ),
            key=lambda layer: (-layer.cycles, layer.index),
        )
        chunk, pg = page(layers, offset, limit)

        def tensors(nodes: list[dict[str, Any]]) -> list[ArchiveTensor]:
            return [
                ArchiveTensor(
                    name=n["name"],
                    shape=list(n.get("shape") or []),
                    dtype=n.get("dtype"),
                    layout=n.get("layout"),
                )
                for n in nodes
            ]

        return InspectArchiveOut(
            archive=s["archive"],
            name=s["name"],
            target=s["target"],
            model_path=s["model_path"],
            model_checksum=s["model_checksum"],
            custom_string=s["custom_string"],
            desired_batch_size=s["desired_batch_size"],
            actual_batch_size=s["actual_batch_size"],
            elf_files=s["elf_files"],
            elf_count=len(s["elf_files"]),
            files=len(s["files"]),
            inputs=tensors(s["input_nodes"]),
            outputs=tensors(s["output_nodes"]),
            plugins=[ArchivePlugin(**p) for p in s["plugins"]],
            layers_page=pg,
            layers=chunk,
            notes=list(s["notes"]),
        )

    @register_tool(mcp, title="Run an archive", read_only=True, idempotent=True)
    async def run_archive(
        ctx: Context,
        archive: PathArg,
        inputs: Annotated[
            str | None,
            Field(
                description=".npz under an allowed root keyed by input name (NCHW, frames on "
                "axis 0). Omitted: seeded random inputs."
            ),
        ] = None,
        frames: Annotated[int, Field(ge=1, le=64, description="Random frames.")] = 1,
        seed: Annotated[
            int, Field(ge=0, description="Seed of the random inputs when no inputs file is given.")
        ] = 0,
        compare_reference: Annotated[
            bool,
            Field(
                description="Also run the QDQ model in the integer reference executor and "
                "report bit_exact per output."
            ),
        ] = False,
        reference_model: Annotated[
            str | None,
            Field(
                description="Workspace model holding the compiled QDQ version (default: the "
                "model_path the archive records)."
            ),
        ] = None,
        reference_version: VersionArg = "latest",
    ) -> RunArchiveOut:
        """Run the archive's pipeline: CVU kernels in numpy, MLA stages in the bit-exact
        emulator. Outputs are summarised (shape, min/max/mean), never returned whole; with
        compare_reference each output says whether it equals the integer reference bit for
        bit, which is what proves the compiled program computes the quantized model."""
        from compiler.archive import read_archive
        from compiler.runtime.compare import compare_with_reference, random_inputs
        from compiler.runtime.pipeline import run_archive as core_run
        from compiler.runtime.pipeline import run_notes
        from surgery.model import read_model
        from surgery.verify import load_inputs

        opened = read_archive(state.input_path(archive))
        if inputs is not None:
            npz = state.input_path(inputs)
            names = [node["name"] for node in opened.manifest["input_nodes"]]
            feed, source = load_inputs(npz, names), str(npz)
        else:
            feed = random_inputs(opened.manifest, frames, seed)
            source = f"random seed {seed}"
        ref_path = (
            reference_path(opened, reference_model, reference_version)
            if compare_reference
            else None
        )
        await ctx.report_progress(0, 2, f"running {opened.name} on {source}")

        def work() -> tuple[dict[str, np.ndarray], Any, Any]:
            try:
                outputs, stats = core_run(opened, feed, keep_tensors=ref_path is not None)
            except (RuntimeError, ValueError) as error:
                if isinstance(error, SurgeryError):
                    raise
                raise SurgeryError(f"running {opened.path} failed: {error}") from error
            comparison = (
                compare_with_reference(
                    opened.manifest, read_model(ref_path), feed, outputs, stats.tensors
                )
                if ref_path is not None
                else None
            )
            return outputs, stats, comparison

        outputs, stats, comparison = await anyio.to_thread.run_sync(work)
        rows = []
        for out_name, value in outputs.items():
            row = RunOutputSummary(
                name=out_name,
                shape=list(value.shape),
                dtype=str(value.dtype),
                min=_stat(value, np.min),
                max=_stat(value, np.max),
                mean=_stat(value, np.mean),
            )
            if comparison is not None:
                verdict = comparison.outputs[out_name]
                row.bit_exact = verdict["bit_exact"]
                row.max_abs_diff_vs_reference = verdict["max_abs_diff_vs_reference"]
            rows.append(row)
        d = stats.to_dict()
        await ctx.report_progress(2, 2, f"{d['frames']} frame(s) in {d['wall_seconds']:.3f} s")
        return RunArchiveOut(
            archive=str(opened.path),
            inputs=source,
            frames=d["frames"],
            actual_batch_size=d["actual_batch_size"],
            outputs=rows[:MAX_OUTPUTS],
            compared_with_reference=compare_reference,
            reference_model=str(ref_path) if ref_path is not None else None,
            bit_exact=comparison.bit_exact if comparison is not None else None,
            mla_bit_exact=comparison.mla_bit_exact if comparison is not None else None,
            reference_note=comparison.explanation() if comparison is not None else None,
            latency_us_per_frame=d["latency_us_per_frame"],
            host_measured_us_per_frame=d["host_measured_us_per_frame"],
            mla_static_cycles=d["mla_static_cycles"],
            wall_seconds=d["wall_seconds"],
            stages=[RunStage(**{k: s[k] for k in RunStage.model_fields}) for s in d["stages"]],
            notes=run_notes(opened.manifest["input_nodes"], feed, outputs),
        )
