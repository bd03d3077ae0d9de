"""Export YOLO-family models with Ultralytics' own ONNX exporter, for `pipeline_sweep.py`.

Ultralytics' `model.export(format="onnx")` is how most users get a YOLO ONNX file: it calls
torch.onnx.export with dynamo=False (the TorchScript exporter), the Detect head in export mode
(box decoding, DFL and the anchor grid inside the graph; one (1, 4+nc, N) output), optionally
onnxslim. Models are built from the packaged yaml files with random weights (no downloads; the
weights do not matter for mapping, quantizing and bit-exact compiling). Writes an INDEX.tsv with
the input shapes (`run_inputs`) the sweep reads:

    python bench/export_ultralytics_models.py --out /tmp/ultra_models [--only NAME ...]
    python bench/pipeline_sweep.py --models /tmp/ultra_models --target mlsoc rk3588

Needs ultralytics (8.4.190 measured; and torch, onnx, onnxslim for simplify=True), which model-surgery itself
does not depend on: run it from a separate environment. A model that fails to build or export
is listed with its error and skipped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from corpus import earlier_rows, run_inputs_text, write_index

os.environ.setdefault("YOLO_OFFLINE", "1")  # no hub / asset / font downloads
os.environ.setdefault("YOLO_VERBOSE", "False")

# name → (yaml, imgsz, opset, simplify[, extra export kwargs]). nms: None = raw head for external
# NMS (the default), False = the NMS-free one2one head (TopK/GatherElements), True = NMS inside
# the graph; dynamic=True = dynamic batch/height/width (the sweep fixes them from INDEX.tsv).
MODELS: dict[str, tuple] = {
    "yolov3u_tiny_op12": ("yolov3-tinyu.yaml", 320, 12, False),
    "yolov5nu_op13": ("yolov5nu.yaml", 320, 13, False),
    "yolov6n_op14": ("yolov6n.yaml", 320, 14, False),
    "yolov8n_op12": ("yolov8n.yaml", 320, 12, False),
    "yolov8n_op17_slim": ("yolov8n.yaml", 320, 17, True),
    "yolov8n_640_op17": ("yolov8n.yaml", 640, 17, False),
    "yolov8n_seg_op15": ("yolov8n-seg.yaml", 320, 15, False),
    "yolov8n_pose_op16": ("yolov8n-pose.yaml", 320, 16, False),
    "yolov8n_obb_op17": ("yolov8n-obb.yaml", 320, 17, False),
    "yolov8n_cls_op13": ("yolov8n-cls.yaml", 224, 13, False),
    "yolov8n_ghost_op14": ("yolov8n-ghost.yaml", 320, 14, False),
    "yolov9t_op14": ("yolov9t.yaml", 320, 14, False),
    "yolov10n_op13": ("yolov10n.yaml", 320, 13, False),
    "yolov10n_op17_slim": ("yolov10n.yaml", 320, 17, True),
    "yolo11n_op17": ("yolo11n.yaml", 320, 17, False),
    "yolo11n_op13_slim": ("yolo11n.yaml", 320, 13, True),
    "yolo11n_seg_op17": ("yolo11n-seg.yaml", 320, 17, False),
    "yolo11n_pose_op12": ("yolo11n-pose.yaml", 320, 12, False),
    "yolo11n_obb_op16_slim": ("yolo11n-obb.yaml", 320, 16, True),
    "yolo11n_cls_op17": ("yolo11n-cls.yaml", 224, 17, False),
    "yolo12n_op17": ("yolo12n.yaml", 320, 17, False),
    "yolo26n_op17": ("yolo26n.yaml", 320, 17, False),
    "yolo26n_e2e_op17": ("yolo26n.yaml", 320, 17, False, {"nms": False}),
    "yolov10n_e2e_op13": ("yolov10n.yaml", 320, 13, False, {"nms": False}),
    "yolo11n_nms_op17": ("yolo11n.yaml", 320, 17, False, {"nms": True}),
    "yolov8n_dyn_op17": ("yolov8n.yaml", 320, 17, False, {"dynamic": True}),
    "yolo11n_dyn_op17_slim": ("yolo11n.yaml", 320, 17, True, {"dynamic": True}),
    "yolo11n_rect_op17": ("yolo11n.yaml", (256, 416), 17, False),
    "yolo11n_seg_dyn_op16": ("yolo11n-seg.yaml", 320, 16, False, {"dynamic": True}),
    "rtdetr_l_op16": ("rtdetr-l.yaml", 320, 16, False),
    "rtdetr_r50_op17": ("rtdetr-resnet50.yaml", 320, 17, False),
    "yoloe_11s_op17": ("yoloe-11s.yaml", 320, 17, False),
}


def export_one(
    yaml: str, imgsz: int | tuple[int, int], opset: int, simplify: bool, dest: Path, extra: dict
) -> None:
    from ultralytics import RTDETR, YOLO

    cls = RTDETR if yaml.startswith("rtdetr") else YOLO
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # the exporter writes next to the (virtual) weights file
        try:
            model = cls(yaml)
            out = model.export(
                format="onnx",
                imgsz=imgsz,
                opset=opset,
                simplify=simplify,
                batch=1,
                device="cpu",
                verbose=False,
                **{"dynamic": False, **extra},
            )
            shutil.move(str(out), dest)
        finally:
            os.chdir(cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="export only these names")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = earlier_rows(args.out)
    for name, (yaml, imgsz, opset, simplify, *extra) in MODELS.items():
        if args.only and name not in args.only:
            continue
        path = args.out / f"{name}.onnx"
        try:
            export_one(yaml, imgsz, opset, simplify, path, extra[0] if extra else {})
            h, w = imgsz if isinstance(imgsz, tuple) else (imgsz, imgsz)
            rows[path.name] = run_inputs_text({"images": [1, 3, h, w]})
            print(f"ok    {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next model
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    write_index(args.out, rows)


if __name__ == "__main__":
    main()
