"""`surgery quantize` and `surgery analyze`: post-training quantization and per-layer error.

`quantize` holds the last `--holdout` samples of `--calib` out of calibration and reports the
final outputs' SQNR and cosine against the float model on them, so the number printed is not
measured on the data the ranges were fitted to. Progress goes to stderr; `--json` prints one
document on stdout.
"""

import copy
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from surgery.cli.app import (
    EXIT_OK,
    EXIT_VERDICT,
    app,
    console,
    emit_json,
    err_console,
    handle_errors,
    refuse_overwrite,
)
from surgery.cli.options import InputShapeOpt, JsonOpt, ModelArg, TargetOpt
from surgery.errors import SurgeryError
from surgery.model import parse_input_shapes

if TYPE_CHECKING:  # the quantizer loads only in the commands that use it
    from compiler.quantize.data import CalibrationDataset

METHODS = ("mse", "minmax", "moving_average", "entropy", "percentile")
MAX_LISTED = 3
"""Unusable calibration files named in one error message."""
LOG_EVERY_SECONDS = 5.0
"""How often progress is logged when stderr is not a terminal."""


@contextmanager
def _progress(label: str, quiet: bool) -> Iterator[Callable[[int, int | None], None]]:
    """A rich progress bar on stderr; to a pipe or log (CI), a plain line every few seconds;
    nothing with --json."""
    if quiet:
        yield lambda done, total: None
        return
    if not err_console.is_terminal:
        last = [time.monotonic()]

        def log_line(done: int, total: int | None) -> None:
            if time.monotonic() - last[0] >= LOG_EVERY_SECONDS or done == total:
                last[0] = time.monotonic()
                err_console.print(f"{label}: {done}/{total or '?'} samples", highlight=False)

        yield log_line
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with RichProgress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _method(name: str, percentile: float, bins: int) -> Any:
    from compiler.defines import (
        HistogramEntropyMethod,
        HistogramMSEMethod,
        HistogramPercentileMethod,
        MinMaxMethod,
        MovingAverageMinMaxMethod,
    )

    if name not in METHODS:
        raise SurgeryError(f"--method {name!r}: expected one of {', '.join(METHODS)}")
    make = {
        "mse": lambda: HistogramMSEMethod(num_bins=bins),
        "minmax": MinMaxMethod,
        "moving_average": MovingAverageMinMaxMethod,
        "entropy": lambda: HistogramEntropyMethod(num_bins=bins),
        "percentile": lambda: HistogramPercentileMethod(percentile, bins),
    }[name]
    try:
        return make()
    except ValueError as exc:  # the method's own check, e.g. "num_bins=0: needs an integer ≥ 128"
        field, _, reason = str(exc).partition(": ")
        option = {"num_bins": "--bins", "percentile": "--percentile"}
        key = field.partition("=")[0]
        if key in option and reason:
            shown = f"{percentile:g}" if key == "percentile" else str(bins)
            raise SurgeryError(f"{option[key]} {shown}: {reason}") from None
        raise SurgeryError(f"--method {name}: {exc}") from None


def _params(
    method: Any,
    bits: int,
    per_tensor_weights: bool,
    symmetric_activations: bool,
    equalize: bool,
    bias_correction: bool,
    unquantized: list[str],
) -> Any:
    from compiler.defines import QuantizationParams, quantization_scheme

    if bits not in (8, 16):
        raise SurgeryError(f"--bits {bits}: expected 8 or 16")
    try:
        params = QuantizationParams(
            calibration_method=method,
            activation_quantization_scheme=quantization_scheme(
                asymmetric=not symmetric_activations, per_channel=False, bits=bits
            ),
            weight_quantization_scheme=quantization_scheme(
                asymmetric=False, per_channel=not per_tensor_weights, bits=8
            ),
            channel_equalization=equalize,
            bias_correction=bias_correction,
        )
    except ValueError as exc:
        raise SurgeryError(str(exc)) from None
    return params.with_unquantized_nodes(*unquantized) if unquantized else params


def _split(
    dataset: "CalibrationDataset", holdout: int
) -> "tuple[CalibrationDataset, CalibrationDataset]":
    """Calibration rows and the last `holdout` rows, as two lazy datasets over the same files."""
    from compiler.quantize.errors import CalibrationDataError

    rows = list(dataset.rows)
    if holdout < 0:
        raise SurgeryError(f"--holdout {holdout}: must be 0 or more")
    if holdout >= len(rows):
        # Few samples: often because the others were not samples at all. Say which files.
        problems = dataset.unusable()
        needed = (
            f"--holdout {holdout}: --calib has {len(rows)} samples; at least one must be left "
            "for calibration"
        )
        if problems:
            shown = "; ".join(p.message for p in problems[:MAX_LISTED])
            more = f"; … ({len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
            raise CalibrationDataError(
                f"{dataset.source}: {len(problems)} of {len(rows)} samples cannot be used: "
                f"{shown}{more}",
                hint=needed,
            )
        raise SurgeryError(needed)
    calib, held = copy.copy(dataset), copy.copy(dataset)
    calib.rows, held.rows = rows[: len(rows) - holdout], rows[len(rows) - holdout :]
    return calib, held


def _analyze_command(
    model_path: Path,
    out_path: Path,
    calib: Path,
    input_shape: list[str] | None,
    mean: list[float] | None,
    std: list[float] | None,
    bgr: bool,
) -> str:
    """The `surgery analyze` command line for this quantization, with the same data options."""
    words = ["surgery analyze", str(model_path), str(out_path), "--data", str(calib)]
    words += [f"--input-shape {s}" for s in input_shape or []]
    words += [f"--mean {v:g}" for v in mean or []] + [f"--std {v:g}" for v in std or []]
    return " ".join(words + (["--bgr"] if bgr else []))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "exact" if value is None else f"{value:.{digits}f}"


@app.command("quantize")
@handle_errors
def quantize_command(
    model_path: ModelArg,
    calib: Annotated[
        Path,
        typer.Option(
            "--calib", help="Calibration data: image folder, .npy/.npz folder or dataset.txt."
        ),
    ],
    input_shape: InputShapeOpt = None,
    method: Annotated[str, typer.Option(help=f"Calibration method: {', '.join(METHODS)}.")] = "mse",
    percentile: Annotated[float, typer.Option(help="Percentile for --method percentile.")] = 99.99,
    bins: Annotated[int, typer.Option(help="Histogram bins (mse/entropy/percentile).")] = 2048,
    per_tensor_weights: Annotated[
        bool, typer.Option("--per-tensor-weights", help="One weight scale per tensor.")
    ] = False,
    symmetric_activations: Annotated[
        bool, typer.Option("--symmetric-activations", help="Activations with zero point 0.")
    ] = False,
    bits: Annotated[int, typer.Option(help="Activation bits: 8 or 16.")] = 8,
    equalize: Annotated[
        bool, typer.Option("--equalize", help="Cross-layer equalization first.")
    ] = False,
    bias_correction: Annotated[
        bool, typer.Option("--bias-correction", help="Correct conv biases (second pass).")
    ] = False,
    auto_hybrid: Annotated[
        float | None,
        typer.Option(
            "--auto-hybrid",
            help="Raise layers whose single-layer cosine is under THRESH (e.g. 0.98) to int16 "
            "(bf16 on modalix).",
            metavar="THRESH",
        ),
    ] = None,
    hybrid_metric: Annotated[
        str,
        typer.Option(
            "--hybrid-metric",
            help="Error --auto-hybrid judges: single (the layer fed float inputs) or entire "
            "(accumulated from the input).",
        ),
    ] = "single",
    target_sqnr: Annotated[
        float | None,
        typer.Option(
            "--target-sqnr",
            help="Raise the layers whose error hurts the outputs most until every output, and "
            "every part of an output that concatenates (boxes ‖ scores), reaches DB dB on the "
            "calibration samples (auto-hybrid by output sensitivity).",
            metavar="DB",
        ),
    ] = None,
    unquantized: Annotated[
        list[str] | None,
        typer.Option("--unquantized", help="Keep this node float (repeatable).", metavar="NODE"),
    ] = None,
    mean: Annotated[
        list[float] | None,
        typer.Option(
            help="Per-channel mean in pixel units 0-255 (repeat): images are fed as "
            "(pixel - mean) / std. Without --mean and --std, pixels / 255 (values in [0, 1])."
        ),
    ] = None,
    std: Annotated[
        list[float] | None,
        typer.Option(help="Per-channel std in pixel units (repeat); see --mean."),
    ] = None,
    bgr: Annotated[bool, typer.Option("--bgr", help="Feed images as BGR.")] = False,
    target: TargetOpt = "mlsoc",
    holdout: Annotated[
        int, typer.Option(help="Last N samples of --calib: evaluation only, not calibration.")
    ] = 2,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "--out",
            "-o",
            help="QDQ model path (.onnx; default: <model>_quant.onnx beside the model).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Quantize MODEL post-training to QDQ ONNX and report output SQNR on held-out samples.

    Exit code: 0, 1 when --target-sqnr is not reached (the model is written all the same),
    2 on bad input.
    """
    out_path = output or model_path.with_name(f"{model_path.stem}_quant.onnx")
    refuse_overwrite(out_path, model_path)
    from compiler.api import load_model
    from compiler.quantize import load_calibration_data
    from compiler.quantize.advice import low_sqnr_advice
    from compiler.quantize.holdout import holdout_errors, part_sqnrs
    from compiler.quantize.hybrid import auto_hybrid as run_auto_hybrid
    from compiler.quantize.quantizer import check_quantizable
    from surgery.model import save_model

    # The options first: a typo should not wait for the model and the data to load.
    params = _params(
        _method(method, percentile, bins),
        bits,
        per_tensor_weights,
        symmetric_activations,
        equalize,
        bias_correction,
        list(unquantized or []),
    )
    if hybrid_metric not in ("single", "entire"):
        raise SurgeryError(f"--hybrid-metric {hybrid_metric!r}: expected single or entire")
    shapes = parse_input_shapes(input_shape or [])
    net = load_model(model_path, input_shapes=shapes or None, target=target)
    check_quantizable(net.model, str(model_path))
    dataset = load_calibration_data(
        calib, net.model, input_shapes=shapes or None, mean=mean, std=std, bgr=bgr
    )
    calib_data, held = _split(dataset, holdout)
    hybrid: dict[str, Any] | None = None
    with _progress("calibrating", as_json) as progress:
        if auto_hybrid is not None or target_sqnr is not None:
            result = run_auto_hybrid(
                net.model,
                calib_data,
                params,
                target=net.resolved_target(),
                cos_thresh=auto_hybrid,
                metric=hybrid_metric,  # type: ignore[arg-type]
                target_sqnr_db=target_sqnr,
                progress=progress,
            )
            hybrid = result.to_dict()
            from compiler.api import Model

            q = result.quantized
            model = Model(
                q.model, q.target, net.name, q.params, q.report, _profile=net.resolved_target()
            )
        else:
            model = net.quantize(calib_data, params, progress=progress)
    # Evaluate first: a model ONNX Runtime rejects is reported, not written.
    errors = holdout_errors(net, model, held) if len(held.rows) else {}
    save_model(model.qdq_model, out_path)
    payload: dict[str, Any] = {
        "output": str(out_path),
        "target": model.target,
        "method": method,
        "samples": len(calib_data.rows),
        "holdout": len(held.rows),
        "outputs": errors,
        "quantized_nodes": model.report.get("quantized_nodes"),
    }
    if hybrid is not None:
        payload["auto_hybrid"] = hybrid
    payload["advice"] = low_sqnr_advice(
        {name: e["sqnr_db"] for name, e in errors.items()},
        raised=hybrid is not None or bits == 16,
        raise_layers="--target-sqnr 30",
        raise_parts="--auto-hybrid 0.98",
        analyze=f"`{_analyze_command(model_path, out_path, calib, input_shape, mean, std, bgr)}`",
        part_sqnr_db=part_sqnrs(errors),
    )
    code = EXIT_VERDICT if target_sqnr is not None and not hybrid["converged"] else EXIT_OK
    if as_json:
        emit_json(payload)
        raise typer.Exit(code)
    console.print(
        f"[bold]{escape(str(out_path))}[/]: {payload['quantized_nodes']} nodes quantized, "
        f"method {escape(method)}, "
        f"{payload['samples']} calibration samples"
    )
    if hybrid is not None:
        _print_raised(hybrid)
    table = Table(title=f"final outputs vs float on {len(held.rows)} held-out samples")
    for col in ("output", "SQNR dB", "cosine"):
        table.add_column(col)
    for name, err in errors.items():
        table.add_row(escape(str(name)), _fmt(err["sqnr_db"]), _fmt(err["cosine"], 5))
        for part, perr in err.get("parts", {}).items():
            table.add_row(
                f"  part from {escape(str(part))}", _fmt(perr["sqnr_db"]), _fmt(perr["cosine"], 5)
            )
    if errors:
        console.print(table)
    else:
        console.print(
            "no held-out samples (--holdout 0): the outputs' SQNR was not measured; "
            "`surgery verify` or `surgery analyze` compare on other samples",
            highlight=False,
        )
    if payload["advice"]:
        first, *rest = payload["advice"]
        console.print(f"[yellow]{escape(str(first))}[/]", highlight=False)
        for line in rest:
            console.print(f"  try: {escape(str(line))}", highlight=False)
    raise typer.Exit(code)


def _worst_cosine_text(entry: Any, kind: str) -> str:
    """The cosine the ranking uses (`LayerError.worst_cosine`), * when a part's."""
    worst = entry.worst_cosine(kind)
    return _fmt(worst, 5) + (" *" if worst < getattr(entry, kind).cosine else "")


RAISED_SHOWN = 8
"""Raised layers listed on the terminal; --json lists every one."""


def _print_raised(hybrid: dict[str, Any]) -> None:
    """The layers auto-hybrid raised (the first few), and whether it reached its goal."""
    from compiler.quantize.advice import hybrid_outcome

    raised = hybrid["raised"]
    for item in raised[:RAISED_SHOWN]:
        after = item["cosine_after"]
        tail = "" if after is None else f"; after: {_fmt(after, 4)}"
        console.print(
            f"  raised {escape(str(item['layer']))} → {escape(str(item['precision']))} "
            f"({escape(str(item['reason']))}{tail})"
        )
    if len(raised) > RAISED_SHOWN:
        console.print(f"  … and {len(raised) - RAISED_SHOWN} more (every one in --json)")
    outcome = hybrid_outcome(hybrid)
    if outcome:
        colour = "green" if hybrid["converged"] else "yellow"
        console.print(f"[{colour}]{escape(outcome)}[/]", highlight=False)


@app.command("analyze")
@handle_errors
def analyze_command(
    float_model: Annotated[Path, typer.Argument(help="The float model (.onnx).")],
    quant_model: Annotated[Path, typer.Argument(help="Its QDQ model (.onnx).")],
    data: Annotated[
        Path,
        typer.Option(
            "--data", "--calib", help="Samples: image folder, .npy/.npz folder or dataset.txt."
        ),
    ],
    input_shape: InputShapeOpt = None,
    top: Annotated[int, typer.Option(help="Show the N worst layers (0: all).")] = 20,
    limit: Annotated[int | None, typer.Option(help="Use at most N samples.")] = None,
    mean: Annotated[list[float] | None, typer.Option(help="Per-channel mean (pixels).")] = None,
    std: Annotated[list[float] | None, typer.Option(help="Per-channel std (pixels).")] = None,
    bgr: Annotated[bool, typer.Option("--bgr", help="Feed images as BGR.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Per-layer quantization error (entire and single), worst layers first."""
    from compiler.api import load_model
    from compiler.quantize import load_calibration_data
    from compiler.quantize.analysis import analyze_quantization_error
    from surgery.model import read_model

    shapes = parse_input_shapes(input_shape or [])
    net = load_model(float_model, input_shapes=shapes or None)
    qdq = read_model(quant_model)
    dataset = load_calibration_data(
        data, net.model, input_shapes=shapes or None, mean=mean, std=std, bgr=bgr, limit=limit
    )
    with _progress("analysing", as_json) as progress:
        result = analyze_quantization_error(net.model, qdq, dataset, progress=progress)
    shown = result.layers if top <= 0 else result.layers[:top]
    if as_json:
        payload = result.to_dict()
        payload["layers"] = [entry.to_dict() for entry in shown]
        payload["total_layers"] = len(result.layers)
        emit_json(payload)
        raise typer.Exit(EXIT_OK)
    table = Table(
        title=f"per-layer error, worst first ({result.samples} samples)",
        caption="cos: of the tensor, or of its worst part (a Concat's input) where that is "
        "lower, marked *: the order is by single cos, then entire cos",
    )
    table.add_column("layer", overflow="fold")
    for col in ("entire cos", "entire euc", "single cos", "single euc", "single SQNR"):
        table.add_column(col, justify="right")
    for e in shown:
        table.add_row(
            escape(e.label),
            _worst_cosine_text(e, "entire"),
            _fmt(e.entire.euclidean, 4),
            _worst_cosine_text(e, "single"),
            _fmt(e.single.euclidean, 4),
            _fmt(e.single.sqnr_db if math.isfinite(e.single.sqnr_db) else None),
        )
    console.print(table)
    for name, m in result.outputs.items():
        console.print(
            f"output {escape(str(name))}: cosine {m.cosine:.5f}, "
            f"SQNR {_fmt(m.sqnr_db if math.isfinite(m.sqnr_db) else None)} dB"
        )
