"""What the corpus scripts share: the folder's INDEX.tsv (file, run_inputs) that the export
scripts write and `pipeline_sweep.py` / `check_speed.py` read, and the noise the exporters add
to random weights.

No import of onnx, torch or model-surgery at module level: the export scripts run in their own
environments.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path

INDEX = "INDEX.tsv"


def run_inputs_text(shapes: Mapping[str, Sequence[int]]) -> str:
    """The run_inputs column for `shapes`: "name[1, 3, 640, 640] other[1, 16]"."""
    return " ".join(f"{name}[{', '.join(map(str, dims))}]" for name, dims in shapes.items())


def run_inputs(index: Path) -> dict[str, dict[str, list[int]]]:
    """Concrete input shapes per file from an INDEX.tsv's run_inputs column ({} if none)."""
    shapes: dict[str, dict[str, list[int]]] = {}
    if not index.exists():
        return shapes
    with index.open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            spec = row.get("run_inputs", "")
            entries: dict[str, list[int]] = {}
            for part in spec.split("] "):
                name, _, dims = part.partition("[")
                dims = dims.rstrip("]")
                if name and dims:
                    entries[name.strip()] = [int(d) for d in dims.split(",")]
            shapes[row["file"]] = entries
    return shapes


def earlier_rows(folder: Path) -> dict[str, str]:
    """file → run_inputs of the models an earlier run exported into `folder` and left there,
    so an export with --only adds to the index instead of replacing it."""
    index = folder / INDEX
    if not index.exists():
        return {}
    rows = {}
    for line in index.read_text().splitlines()[1:]:
        file, _, shapes = line.partition("\t")
        if (folder / file).exists():
            rows[file] = shapes
    return rows


def write_index(folder: Path, rows: Mapping[str, str]) -> Path:
    """Write `folder`/INDEX.tsv from file → run_inputs rows; returns its path."""
    index = folder / INDEX
    lines = "".join(f"{file}\t{shapes}\n" for file, shapes in sorted(rows.items()))
    index.write_text("file\trun_inputs\n" + lines)
    print(f"wrote {len(rows)} models and {index}")
    return index


def add_weight_noise(module, scale: float = 0.02) -> None:
    """A little noise on a torch module's random weights: default init leaves biases at 0 and
    norm scales at 1, which `remove-identity` rightly deletes as x + 0 and x * 1, and that
    would make the corpus easier than trained weights."""
    import torch

    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * scale)
