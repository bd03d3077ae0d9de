"""Our quantizer vs ONNX Runtime's `quantize_static`, side by side on the same samples.

For each model (nudenet_320n, ppocrv4_det, mobilenet_v2 from shared/models), calibrated on the
16 of the 22 photos in shared/data/images that docs/quantization.md calibrates on (the other 6
are held out):

* accuracy: final-output SQNR (all outputs of the 6 held-out images together) vs the float
  model, for ours (default: MSE per-channel; and the best of a few configurations, among them
  `hybrid`: auto-hybrid to an output SQNR target of HYBRID_TARGET_DB measured on the
  calibration samples, which raises the most output-sensitive layers to int16) and ORT
  (QDQ, per-channel, int8 activations and weights; MinMax / Entropy / Percentile). Every QDQ
  model — ORT's too — runs float-simulated (Q/DQ not fused into ORT's int8 kernels, via
  `compiler.quantize.calibrate.reference_session`), so rounding of ORT's x86 int8 kernels does
  not count against either side.
* cost: wall time and peak RSS of calibration + quantization at 8, 32 and 128 samples (the 16
  photos repeated with flips and crops to reach 128).

Each run is a subprocess: the parent polls /proc/<pid>/status, kills a run whose resident set
passes the memory cap (`killed (> cap)`) or that passes the timeout (`timeout`), and the child
reports its own VmHWM (peak RSS, which includes the Python/ORT baseline and the model).

    python bench/quant_vs_ort.py [--models nudenet ppocr mobilenet] [--cap-gb 10] [--timeout 600]

PP-OCRv4 is measured at 640×640 for accuracy and at 320×320 for the cost sweep (ORT's
histogram methods keep every activation of every sample; at 640 they pass the cap early).
Prints a table and writes bench/results/quant_vs_ort.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
IMAGES = SHARED / "data" / "images"
MODELS = SHARED / "models"
RESULTS = Path(__file__).resolve().parent / "results" / "quant_vs_ort.json"
HOLDOUT = ("brick", "clock_motion", "grass", "ihc", "motorcycle_right", "page")
IMAGENET = ([123.675, 116.28, 103.53], [58.395, 57.12, 57.375])

SPECS: dict[str, dict[str, Any]] = {
    "nudenet": {
        "file": "nudenet_320n.onnx",
        "input": "images",
        "accuracy_shape": [1, 3, 320, 320],
        "sweep_shape": [1, 3, 320, 320],
        "norm": None,
    },
    "ppocr": {
        "file": "ppocrv4_det.onnx",
        "input": "x",
        "accuracy_shape": [1, 3, 640, 640],
        "sweep_shape": [1, 3, 320, 320],
        "norm": IMAGENET,
    },
    "mobilenet": {
        "file": "mobilenet_v2.onnx",
        "input": None,
        "accuracy_shape": None,
        "sweep_shape": None,
        "norm": IMAGENET,
    },
}

OURS_CONFIGS = ("mse", "minmax", "percentile", "mse+cle+bc", "hybrid")
HYBRID_TARGET_DB = 30.0
"""Output SQNR the `hybrid` configuration aims at on the calibration samples (never the
held-out ones; text-free calibration photos give PP-OCRv4 a pessimistic SQNR)."""
ORT_METHODS = ("MinMax", "Entropy", "Percentile")


# --------------------------------------------------------------------------- data


def _image_paths() -> tuple[list[Path], list[Path]]:
    paths = sorted(p for p in IMAGES.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    held = [p for p in paths if p.stem in HOLDOUT]
    return [p for p in paths if p.stem not in HOLDOUT], held


def _preprocess(path: Path, variant: int, shape: list[int], norm: Any) -> np.ndarray:
    """Variant 0 is the photo; others add flips and centre crops so 16 photos make 128."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    if variant % 8 >= 4:
        w, h = img.size
        f = 0.9 - 0.1 * (variant // 8)
        img = img.crop(
            (int(w * (1 - f) / 2), int(h * (1 - f) / 2), int(w * (1 + f) / 2), int(h * (1 + f) / 2))
        )
    if variant % 2:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if variant % 4 >= 2:
        img = img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
    img = img.resize((shape[3], shape[2]), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.float32)
    if norm is None:
        arr = arr / 255.0
    else:
        arr = (arr - np.array(norm[0], np.float32)) / np.array(norm[1], np.float32)
    return arr.transpose(2, 0, 1)[None].copy()


class Samples:
    """`n` calibration samples made lazily (memory does not count them)."""

    def __init__(self, paths: list[Path], n: int, shape: list[int], norm: Any, name: str):
        self.paths, self.n, self.shape, self.norm, self.name = paths, n, shape, norm, name

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for k in range(self.n):
            path = self.paths[k % len(self.paths)]
            yield {self.name: _preprocess(path, k // len(self.paths), self.shape, self.norm)}


# --------------------------------------------------------------------------- one run (child)


def _our_params(config: str) -> Any:
    from compiler.defines import (
        HistogramPercentileMethod,
        MinMaxMethod,
        default_quantization,
    )

    return {
        "mse": default_quantization,
        "minmax": default_quantization.with_calibration(MinMaxMethod()),
        "percentile": default_quantization.with_calibration(HistogramPercentileMethod(99.99, 2048)),
        "mse+cle+bc": default_quantization.with_channel_equalization().with_bias_correction(),
        "hybrid": default_quantization,
    }[config]


class _OrtReader:
    def __init__(self, samples: Samples) -> None:
        self.it = iter(samples)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.it, None)

    def rewind(self) -> None:
        raise NotImplementedError


def _quantize(job: dict[str, Any], samples: Samples, out: Path) -> None:
    import onnx

    if job["tool"] == "ours":
        from compiler.quantize import quantize_model
        from compiler.quantize.hybrid import auto_hybrid

        model, params = onnx.load(job["model"]), _our_params(job["config"])
        if job["config"] == "hybrid":
            result = auto_hybrid(model, samples, params, target_sqnr_db=HYBRID_TARGET_DB).quantized
        else:
            result = quantize_model(model, samples, params)
        onnx.save(result.model, out)
        return
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    reader = _OrtReader(samples)
    quantize_static(
        job["model"],
        str(out),
        reader,  # type: ignore[arg-type]
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=getattr(CalibrationMethod, job["config"]),
    )


def _sqnr(job: dict[str, Any], qdq_path: Path) -> float:
    import onnx

    from compiler.quantize.calibrate import reference_session

    float_sess = reference_session(onnx.load(job["model"]))
    quant_sess = reference_session(onnx.load(qdq_path))
    _, held = _image_paths()
    signal = noise = 0.0
    for path in held:
        feed = {job["input"]: _preprocess(path, 0, job["shape"], job["norm"])}
        for ref, got in zip(float_sess.run(None, feed), quant_sess.run(None, feed), strict=True):
            ref64, got64 = np.asarray(ref, np.float64), np.asarray(got, np.float64)
            signal += float(np.square(ref64).sum())
            noise += float(np.square(ref64 - got64).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(job: dict[str, Any]) -> dict[str, Any]:
    calib, _ = _image_paths()
    samples = Samples(calib, job["samples"], job["shape"], job["norm"], job["input"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q.onnx"
        started = time.perf_counter()
        _quantize(job, samples, out)
        seconds = time.perf_counter() - started
        peak = _vm_hwm_mb()
        result: dict[str, Any] = {"seconds": round(seconds, 2), "peak_rss_mb": round(peak, 1)}
        if job.get("evaluate"):
            result["sqnr_db"] = round(_sqnr(job, out), 2)
    return result


# --------------------------------------------------------------------------- the parent


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def run_job(job: dict[str, Any], cap_gb: float, timeout: float) -> dict[str, Any]:
    """One run in a subprocess, killed past `cap_gb` resident or `timeout` seconds."""
    cmd = [sys.executable, __file__, "--child", json.dumps(job)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    started, peak_kb, verdict = time.perf_counter(), 0, None
    while proc.poll() is None:
        peak_kb = max(peak_kb, _status_kb(proc.pid, "VmHWM:"))
        if _status_kb(proc.pid, "VmRSS:") > cap_gb * 2**20:
            verdict = f"killed (> {cap_gb:g} GB)"
        elif time.perf_counter() - started > timeout:
            verdict = f"timeout (> {timeout:g} s)"
        if verdict:
            proc.kill()
            proc.wait()
            return {"status": verdict, "peak_rss_mb": round(peak_kb / 1024, 1)}
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["?"])[-1][:200]
        return {"status": f"failed (exit {proc.returncode}): {last}"}
    result = json.loads(stdout.strip().splitlines()[-1])
    result["status"] = "ok"
    return result


def _fixed_model(spec: dict[str, Any], shape: list[int] | None, folder: Path) -> tuple[str, str]:
    """The float model with its input shape fixed (both quantizers get the same file)."""
    import onnx

    from surgery.model import load_model

    source = MODELS / spec["file"]
    raw = onnx.load(source)
    name = spec["input"] or raw.graph.input[0].name
    model = load_model(source, {name: shape} if shape else None)
    dims = "x".join(map(str, shape)) if shape else "native"
    path = folder / f"{source.stem}_{dims}.onnx"
    onnx.save(model, path)
    return str(path), name


def _input_shape(path: str) -> list[int]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--cap-gb", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--sweep", nargs="+", type=int, default=[8, 32, 128])
    parser.add_argument(
        "--configs", nargs="+", default=list(OURS_CONFIGS), choices=list(OURS_CONFIGS)
    )
    parser.add_argument("--no-ort", action="store_true", help="skip ORT's accuracy runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    calib, held = _image_paths()
    report: dict[str, Any] = {
        "calibration_images": len(calib),
        "held_out": [p.stem for p in held],
        "cap_gb": args.cap_gb,
        "timeout_s": args.timeout,
        "note": "every QDQ model (ours and ORT's) runs float-simulated: Q/DQ fusion off",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models:
            spec = SPECS[key]
            acc_model, name = _fixed_model(spec, spec["accuracy_shape"], Path(tmp))
            sweep_model = acc_model
            if spec["sweep_shape"] != spec["accuracy_shape"]:
                sweep_model, _ = _fixed_model(spec, spec["sweep_shape"], Path(tmp))
            base = {"input": name, "norm": spec["norm"]}
            entry: dict[str, Any] = {
                "accuracy_shape": _input_shape(acc_model),
                "sweep_shape": _input_shape(sweep_model),
                "accuracy": {},
                "sweep": {},
            }
            acc_jobs = [("ours", c) for c in args.configs]
            acc_jobs += [] if args.no_ort else [("ort", m) for m in ORT_METHODS]
            for tool, config in acc_jobs:
                job = dict(base, tool=tool, config=config, model=acc_model, evaluate=True)
                job.update(samples=len(calib), shape=entry["accuracy_shape"])
                res = run_job(job, args.cap_gb, args.timeout)
                entry["accuracy"][f"{tool}:{config}"] = res
                print(f"{key:10s} accuracy {tool}:{config:12s} {res}", flush=True)
            for n in args.sweep:
                for tool, config in [("ours", "mse")] + [("ort", m) for m in ORT_METHODS]:
                    job = dict(base, tool=tool, config=config, model=sweep_model, evaluate=False)
                    job.update(samples=n, shape=entry["sweep_shape"])
                    res = run_job(job, args.cap_gb, args.timeout)
                    entry["sweep"][f"{tool}:{config}@{n}"] = res
                    print(f"{key:10s} sweep {tool}:{config}@{n:<4d} {res}", flush=True)
            report["models"][key] = entry
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    _print_tables(report)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")


def _cell(res: dict[str, Any], field: str, unit: str = "") -> str:
    if res.get("status") != "ok":
        return res.get("status", "?").split(":")[0]
    value = res.get(field)
    return "-" if value is None else f"{value}{unit}"


def _print_tables(report: dict[str, Any]) -> None:
    print("\nfinal-output SQNR (dB) vs float, 6 held-out images, float-simulated QDQ")
    cols = [f"ours:{c}" for c in OURS_CONFIGS] + [f"ort:{m}" for m in ORT_METHODS]
    print(f"{'model':10s} " + " ".join(f"{c:>16s}" for c in cols))
    for key, entry in report["models"].items():
        acc = entry["accuracy"]
        cells = [_cell(acc[c], "sqnr_db") if c in acc else "-" for c in cols]
        print(f"{key:10s} " + " ".join(f"{c:>16s}" for c in cells))
    print("\ncalibration + quantization: seconds / peak RSS MB")
    for key, entry in report["models"].items():
        print(f"{key} (input {entry['sweep_shape']})")
        for run, res in entry["sweep"].items():
            print(
                f"  {run:22s} {_cell(res, 'seconds', ' s'):>22s} {_cell(res, 'peak_rss_mb'):>22s}"
            )


if __name__ == "__main__":
    main()
