"""`surgery fix` wall time and outcome per real model (the bar: yolov8n under 30 s).

Prints a table and writes bench/results/fix_speed.json.

    python bench/fix_speed.py [--models yolov8n nudenet_320n ...] [--target mlsoc]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from surgery.model import load_model
from surgery.rules.fix import fix_model

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT.parent / "shared" / "models"
RUN_INPUTS = {
    "nudenet_320n": {"images": [1, 3, 320, 320]},
    "ppocrv4_det": {"x": [1, 3, 640, 640]},
    "ppocr_mobile_v2_cls": {"x": [1, 3, 48, 192]},
}
DEFAULT = [
    "yolov8n",
    "nudenet_320n",
    "yolov5n_anchor",
    "mobilenet_v2",
    "ppocrv4_det",
    "vit_tiny_patch16_224",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=DEFAULT)
    parser.add_argument("--target", default="mlsoc")
    parser.add_argument("--allow-approximate", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fix_speed.json")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        path = MODELS / f"{name}.onnx"
        if not path.exists():
            print(f"{name}: not found, skipped")
            continue
        start = time.perf_counter()
        result = fix_model(
            load_model(path, RUN_INPUTS.get(name)),
            args.target,
            allow_approximate=args.allow_approximate,
        )
        seconds = time.perf_counter() - start
        data = result.to_dict()
        worst = max((s["verify"]["max_abs"] for s in data["steps"]), default=0.0)
        rows.append(
            {
                "model": name,
                "seconds": round(seconds, 2),
                "single_elf": data["single_elf"],
                "segments": f"{data['mla_segments_before']}→{data['mla_segments_after']}",
                "mla_mac_fraction": f"{data['mla_mac_fraction_before']:.3f}→{data['mla_mac_fraction_after']:.3f}",
                "steps": [s["rule"] for s in data["steps"]],
                "worst_max_abs": worst,
                "all_verified": all(s["verify"]["passed"] for s in data["steps"]),
            }
        )
        r = rows[-1]
        print(
            f"{name:24s} {r['seconds']:6.1f} s  single_elf={r['single_elf']!s:5s} segments {r['segments']:6s} "
            f"MLA MACs {r['mla_mac_fraction']}  steps {len(r['steps'])}  worst |err| {worst:.2g}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"target": args.target, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
