"""Options shared by several commands, declared once so their help text stays consistent."""

from pathlib import Path
from typing import Annotated

import typer

ModelArg = Annotated[
    Path, typer.Argument(help="ONNX model file (.onnx; external data beside it is loaded).")
]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target",
        "-t",
        help="Target profile: mlsoc, modalix, rk3588 (see `surgery targets`) or a profile .yaml.",
    ),
]
InputShapeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input-shape",
        "-s",
        help="Fix a dynamic input: NAME=1,3,640,640 (repeatable).",
        metavar="NAME=DIMS",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")
]
