"""The `surgery` console script: the command line, imported with the cyclic collector paused.

Importing the command line (onnx, numpy, pydantic, typer, rich, the target profiles and the
rules) creates some 50,000 long-lived container objects and next to no garbage, and the
collections that allocation triggered traversed them over and over: `surgery check
mobilenet_v2.onnx --json` spent 42-48 ms of its 0.36 s in 127 collections, 3-4 ms in 5 with
the collector paused. The imported objects are then frozen (no collection traverses them
again) and the collector resumes before the command runs, so a long command (`fix`,
`compile`, `serve`) collects its own garbage as before.
"""

from __future__ import annotations

import gc


def main() -> None:
    collecting = gc.isenabled()
    gc.disable()
    try:
        from server.cli import main as run_command_line

        gc.freeze()
    finally:
        if collecting:
            gc.enable()
    run_command_line()
