"""Calibration data from disk, read lazily: a folder of images, a folder of .npy/.npz files, or an
RKNN-style dataset.txt (one sample per line, space-separated paths, one per model input).

Nothing is decoded until the quantizer asks for the next sample, and a dataset can be iterated
any number of times (bias correction makes a second pass). Image preprocessing is in one place:
resize (or letterbox) to the model's H×W, RGB or BGR, then (pixel − mean) / std with mean and
std in 0‥255 pixel units as RKNN's mean_values / std_values are; without mean and std, pixels are
scaled to [0, 1]. The layout (NCHW or NHWC) follows the model input unless given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from compiler.quantize.errors import CalibrationDataError
from compiler.quantize.samples import InputSignature, as_feed
from surgery.model import read_model, set_input_shapes

__all__ = ["CalibrationDataset", "ImagePreprocess", "load_calibration_data"]

IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm"}
)
ARRAY_SUFFIXES = frozenset({".npy", ".npz"})
Layout = Literal["NCHW", "NHWC"]


@dataclass(frozen=True)
class ImagePreprocess:
    """How an image file becomes one input tensor."""

    height: int
    width: int
    channels: int
    layout: Layout
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    bgr: bool = False
    letterbox: bool = False
    pad_value: int = 114

    def __call__(self, path: Path) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as img:
                img.load()
                mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(self.channels)
                if mode is None:
                    raise CalibrationDataError(
                        f"{path}: the model input has {self.channels} channels; images have 1, 3 or 4"
                    )
                img = img.convert(mode)
                img = self._fit(img)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            if isinstance(exc, CalibrationDataError):
                raise
            raise CalibrationDataError(f"{path}: cannot decode the image ({exc})") from None
        pixels = np.asarray(img, dtype=np.float32)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.bgr and self.channels >= 3:
            pixels = pixels[:, :, [2, 1, 0, *range(3, self.channels)]]
        pixels = self._normalise(pixels)
        if self.layout == "NCHW":
            pixels = pixels.transpose(2, 0, 1)
        return np.ascontiguousarray(pixels[None], dtype=np.float32)

    def _fit(self, img):  # type: ignore[no-untyped-def]
        from PIL import Image

        if not self.letterbox:
            return img.resize((self.width, self.height), Image.BILINEAR)
        ratio = min(self.width / img.width, self.height / img.height)
        size = (max(1, round(img.width * ratio)), max(1, round(img.height * ratio)))
        resized = img.resize(size, Image.BILINEAR)
        fill = (
            (self.pad_value,) * len(img.getbands()) if len(img.getbands()) > 1 else self.pad_value
        )
        canvas = Image.new(img.mode, (self.width, self.height), fill)
        canvas.paste(resized, ((self.width - size[0]) // 2, (self.height - size[1]) // 2))
        return canvas

    def _normalise(self, pixels: np.ndarray) -> np.ndarray:
        if self.mean is None and self.std is None:
            return pixels / 255.0
        channels = pixels.shape[-1]
        mean = np.asarray(self.mean if self.mean is not None else (0.0,), dtype=np.float32)
        std = np.asarray(self.std if self.std is not None else (1.0,), dtype=np.float32)
        for name, v in (("mean", mean), ("std", std)):
            if v.size not in (1, channels):
                raise CalibrationDataError(
                    f"{name} has {v.size} values; the input has {channels} channels"
                )
        if np.any(std == 0):
            raise CalibrationDataError("std contains 0")
        return (pixels - mean) / std


class CalibrationDataset:
    """A lazy, re-iterable sequence of feed dicts read from files."""

    def __init__(
        self,
        rows: Sequence[Sequence[Path]],
        signature: InputSignature,
        readers: Mapping[str, object],
        source: Path,
    ) -> None:
        self.rows = [list(r) for r in rows]
        self.signature = signature
        self._readers = readers
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for index, row in enumerate(self.rows):
            yield self._load(index, row)

    def unusable(self) -> list[CalibrationDataError]:
        """The samples that cannot be read (or do not fit the model), each as the error that
        reading it raises: it names the file(s) and why. Reads every sample."""
        problems: list[CalibrationDataError] = []
        for index, row in enumerate(self.rows):
            try:
                self._load(index, row)
            except CalibrationDataError as exc:
                problems.append(exc)
        return problems

    def _load(self, index: int, row: Sequence[Path]) -> dict[str, np.ndarray]:
        names = self.signature.names
        if len(row) == 1 and row[0].suffix.lower() == ".npz":
            sample: dict[str, np.ndarray] = _read_npz(row[0])
        else:
            sample = {name: self._read(name, path) for name, path in zip(names, row, strict=True)}
        try:
            return as_feed(sample, self.signature, index)
        except CalibrationDataError as exc:
            raise CalibrationDataError(
                f"{', '.join(map(str, row))}: {exc.message}", hint=exc.hint
            ) from None

    def _read(self, name: str, path: Path) -> np.ndarray:
        if path.suffix.lower() == ".npy":
            try:
                return np.load(path, allow_pickle=False)
            except (OSError, ValueError, EOFError) as exc:
                raise CalibrationDataError(f"{path}: not a readable .npy file ({exc})") from None
        reader = self._readers.get(name)
        if reader is None:
            raise CalibrationDataError(
                f"{path}: input {name!r} is not an image input (give a .npy file)"
            )
        return reader(path)  # type: ignore[operator]


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise CalibrationDataError(f"{path}: not a readable .npz file ({exc})") from None


def _signature(
    model: onnx.ModelProto | str | os.PathLike, input_shapes: Mapping[str, Sequence[int]] | None
) -> InputSignature:
    proto = model if isinstance(model, onnx.ModelProto) else read_model(model)
    inits = {t.name for t in proto.graph.initializer}
    stub = onnx.ModelProto()
    stub.graph.input.extend(vi for vi in proto.graph.input if vi.name not in inits)
    if input_shapes:
        set_input_shapes(stub, input_shapes)
    return InputSignature(stub)


def _image_reader(
    signature: InputSignature,
    name: str,
    layout: Layout | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    bgr: bool,
    letterbox: bool,
) -> ImagePreprocess | None:
    shape = signature.shapes.get(name)
    if shape is None or len(shape) != 4:
        return None
    if layout is None:
        layout = "NHWC" if shape[-1] in (1, 3, 4) and shape[1] not in (1, 3, 4) else "NCHW"
    c, h, w = (shape[1], shape[2], shape[3]) if layout == "NCHW" else (shape[3], shape[1], shape[2])
    if h is None or w is None or c is None:
        raise CalibrationDataError(
            f"input {name!r} has dynamic dimensions {[d if d is not None else '?' for d in shape]}; images need a fixed H×W",
            hint=f"fix it with --input-shape {name}={_example_dims(shape, layout)} (the size "
            "to calibrate, and compile, at)",
        )
    return ImagePreprocess(
        h,
        w,
        c,
        layout,
        tuple(mean) if mean is not None else None,
        tuple(std) if std is not None else None,
        bgr,
        letterbox,
    )


def _example_dims(shape: Sequence[int | None], layout: Layout) -> str:
    """An input size to suggest for a dynamic image input: its known dims, batch 1, three
    channels and 640 for the unknown ones."""
    channel_axis = 1 if layout == "NCHW" else 3
    fill = [1 if k == 0 else 3 if k == channel_axis else 640 for k in range(len(shape))]
    return ",".join(str(d if d is not None else f) for d, f in zip(shape, fill, strict=True))


def load_calibration_data(
    path: str | os.PathLike,
    model: onnx.ModelProto | str | os.PathLike,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    bgr: bool = False,
    limit: int | None = None,
    layout: Layout | None = None,
    letterbox: bool = False,
) -> CalibrationDataset:
    """A dataset for `model` from a folder of images or arrays, a dataset.txt or one .npz/.npy file."""
    source = Path(path)
    if not source.exists():
        raise CalibrationDataError(f"{source}: no such file or folder")
    if limit is not None and limit < 1:
        raise CalibrationDataError(f"limit={limit}: must be at least 1")
    signature = _signature(model, input_shapes)
    names = signature.names
    readers = {
        n: r
        for n in names
        if (r := _image_reader_or_none(signature, n, layout, mean, std, bgr, letterbox)) is not None
    }
    if source.is_dir():
        rows = _folder_rows(source, names, readers)
    elif source.suffix.lower() == ".txt":
        rows = _dataset_txt_rows(source, names)
    elif source.suffix.lower() in ARRAY_SUFFIXES | IMAGE_SUFFIXES:
        rows = [[source]]
    else:
        raise CalibrationDataError(
            f"{source}: expected a folder of images or .npy/.npz files, a dataset.txt, or an .npz/.npy file"
        )
    if limit is not None:
        rows = rows[:limit]
    if any(r[0].suffix.lower() in IMAGE_SUFFIXES for r in rows) and not readers:
        raise CalibrationDataError(
            f"{source}: images given, but no model input is a 4-D image tensor"
        )
    return CalibrationDataset(rows, signature, readers, source)


def _image_reader_or_none(
    signature: InputSignature,
    name: str,
    layout: Layout | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    bgr: bool,
    letterbox: bool,
) -> ImagePreprocess | None:
    try:
        return _image_reader(signature, name, layout, mean, std, bgr, letterbox)
    except CalibrationDataError:
        if len(signature.names) == 1:
            raise
        return None


def _folder_rows(folder: Path, names: list[str], readers: Mapping[str, object]) -> list[list[Path]]:
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    arrays = [p for p in files if p.suffix.lower() in ARRAY_SUFFIXES]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if arrays:
        npy = [p for p in arrays if p.suffix.lower() == ".npy"]
        if npy and len(names) != 1:
            raise CalibrationDataError(
                f"{folder}: .npy files hold one array, but the model has {len(names)} inputs ({', '.join(names)})",
                hint="use one .npz per sample with one key per input name",
            )
        return [[p] for p in arrays]
    if images:
        if len(names) != 1:
            raise CalibrationDataError(
                f"{folder}: a folder of images feeds single-input models; this model has inputs {', '.join(names)}",
                hint="use a dataset.txt with one path per input on each line",
            )
        return [[p] for p in images]
    raise CalibrationDataError(
        f"{folder}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) or .npy/.npz files found"
    )


def _dataset_txt_rows(path: Path, names: list[str]) -> list[list[Path]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationDataError(f"{path}: cannot read ({exc})") from None
    rows: list[list[Path]] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = [Path(p) if Path(p).is_absolute() else path.parent / p for p in text.split()]
        if len(parts) != len(names) and not (len(parts) == 1 and parts[0].suffix.lower() == ".npz"):
            raise CalibrationDataError(
                f"{path}:{number}: {len(parts)} path(s), but the model has {len(names)} input(s) ({', '.join(names)})"
            )
        missing = [p for p in parts if not p.is_file()]
        if missing:
            raise CalibrationDataError(f"{path}:{number}: no such file {missing[0]}")
        rows.append(parts)
    if not rows:
        raise CalibrationDataError(f"{path}: no samples (every line is empty or a comment)")
    return rows
