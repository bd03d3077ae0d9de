"""The pipeline tools over MCP: quantize_model, compile_model, inspect_archive, run_archive.

The scenario is an agent's whole session on the shipped example detector head, driven only by
tool calls: open -> check -> fix -> quantize -> compile -> inspect (one .elf) -> run (bit exact).
The count of calls is printed for the report.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mcp import Client
from mcp.types import Tool

from server.app import create_server
from surgery import examples
from surgery.model import save_model
from tests.test_server_common import (  # noqa: F401  (fixtures)
    Sandbox,
    anyio_backend_fixture,
    call,
    call_error,
    sandbox_fixture,
)

pytestmark = pytest.mark.anyio

PIPELINE_TOOLS = (
    "quantize_model",
    "analyze_quantization",
    "compile_model",
    "inspect_archive",
    "run_archive",
)


class CountingAgent:
    """Calls tools through one client and keeps the tally an agent transcript would show."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.calls: Counter[str] = Counter()
        self.progress: dict[str, list[str]] = {}

    async def __call__(self, tool: str, **args: Any) -> dict:
        self.calls[tool] += 1
        seen = self.progress.setdefault(tool, [])

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            seen.append(message or "")

        result = await self.client.call_tool(tool, args, progress_callback=on_progress)
        assert not result.is_error, f"{tool}: {result.content[0].text}"
        assert result.structured_content is not None
        return result.structured_content

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def calibration_folder(folder: Path, shape: list[int], count: int, seed: int = 0) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for k in range(count):
        np.save(folder / f"sample_{k:02d}.npy", rng.random(shape, dtype=np.float32))
    return folder


async def run_scenario(root: Path, model_file: str, calib_shape: list[int], samples: int) -> dict:
    """open -> check -> fix -> quantize -> compile -> inspect -> run, through MCP only."""
    calib = calibration_folder(root / "calib", calib_shape, samples)
    async with Client(create_server(root / ".surgery", [root])) as client:
        agent = CountingAgent(client)
        opened = await agent("open_model", path=model_file)
        name = opened["model"]
        checked = await agent("check_model", model=name, limit=5)
        if not checked["single_elf"] or checked["blockers_page"]["total"]:
            await agent("fix_model", model=name)
        quantized = await agent("quantize_model", model=name, calibration=str(calib), holdout=2)
        compiled = await agent("compile_model", model=name, output_dir="build")
        inspected = await agent("inspect_archive", archive=compiled["archive"], limit=5)
        ran = await agent("run_archive", archive=compiled["archive"], compare_reference=True)
    return {
        "agent": agent,
        "checked": checked,
        "quantized": quantized,
        "compiled": compiled,
        "inspected": inspected,
        "ran": ran,
    }


async def test_agent_goes_from_float_model_to_bit_exact_run_through_mcp_only(
    tmp_path: Path,
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    save_model(examples.yolo_head(), root / "yolo.onnx")
    before = (root / "yolo.onnx").read_bytes()

    r = await run_scenario(root, "yolo.onnx", [1, 3, 64, 64], samples=6)
    agent, q, c, i, ran = r["agent"], r["quantized"], r["compiled"], r["inspected"], r["ran"]

    assert q["calibration_samples"] == 4 and q["holdout_samples"] == 2
    assert not q["holdout_is_calibration"]
    assert q["worst_sqnr_db"] is not None and float(q["worst_sqnr_db"]) > 10
    assert q["coverage"]["single_elf"]
    assert len(agent.progress["quantize_model"]) >= 4  # per calibration sample (+ start/end)
    assert c["version"] == q["version"]
    assert c["elf_count"] == 1 and c["single_elf"] and c["elf_count_matches_check"]
    assert c["segments"][0]["peak_bytes"] >= c["segments"][0]["lower_bound_bytes"] > 0
    assert Path(c["archive"]).is_file() and Path(c["archive"]).parent == root / "build"
    assert agent.progress["compile_model"]
    assert i["elf_count"] == 1 and i["elf_files"] == c["elf_files"]
    assert [p["processor"] for p in i["plugins"]].count("MLA") == 1
    assert i["layers"] and i["layers"][0]["cycles"] >= i["layers"][-1]["cycles"]
    assert ran["compared_with_reference"] and ran["bit_exact"] is True
    assert all(o["bit_exact"] for o in ran["outputs"])
    assert (root / "yolo.onnx").read_bytes() == before
    assert agent.total <= 7
    print(
        f"\npipeline scenario (yolo_head, mlsoc): {agent.total} tool calls {dict(agent.calls)}; "
        f"SQNR {q['worst_sqnr_db']} dB, {c['elf_count']} .elf, {c['total_cycles']} cycles, "
        f"bit_exact={ran['bit_exact']}"
    )


@pytest.mark.slow
async def test_agent_pipeline_on_yolov8n(tmp_path: Path) -> None:
    from tests.conftest import shared_model

    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(shared_model("yolov8n"), root / "yolov8n.onnx")
    r = await run_scenario(root, "yolov8n.onnx", [1, 3, 640, 640], samples=4)
    c, ran = r["compiled"], r["ran"]
    assert c["elf_count"] == c["check_mla_segments"]
    assert ran["bit_exact"] is True
    print(
        f"\npipeline scenario (yolov8n): {r['agent'].total} tool calls, "
        f"{c['elf_count']} .elf, SQNR {r['quantized']['worst_sqnr_db']} dB"
    )


# --------------------------------------------------------------------------- edges


async def _quantized(client: Client, sandbox: Sandbox, samples: int = 3) -> tuple[str, Path]:
    calib = calibration_folder(sandbox.root / "calib", [1, 3, 64, 64], samples)
    name = (await call(client, "open_model", {"path": "yolo.onnx"}))["model"]
    await call(client, "fix_model", {"model": name})
    await call(client, "quantize_model", {"model": name, "calibration": "calib"})
    return name, calib


async def test_annotations_are_truthful(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        tools: dict[str, Tool] = {t.name: t for t in (await client.list_tools()).tools}
    for name in PIPELINE_TOOLS:
        ann = tools[name].annotations
        assert ann is not None and ann.open_world_hint is False
        assert ann.destructive_hint is False, name
    assert tools["quantize_model"].annotations.read_only_hint is False
    assert tools["compile_model"].annotations.read_only_hint is False
    assert tools["inspect_archive"].annotations.read_only_hint is True
    assert tools["analyze_quantization"].annotations.read_only_hint is True
    assert tools["run_archive"].annotations.read_only_hint is True


async def test_quantize_adds_a_version_and_refuses_paths_outside(sandbox: Sandbox) -> None:
    outside = calibration_folder(sandbox.outside / "calib", [1, 3, 64, 64], 2)
    async with Client(sandbox.server()) as client:
        name, _ = await _quantized(client, sandbox)
        history = await call(client, "history", {"model": name})
        assert history["versions"][0]["action"] == "quantize"
        assert history["versions"][0]["coverage"]["single_elf"]
        text = await call_error(
            client, "quantize_model", {"model": name, "version": 1, "calibration": str(outside)}
        )
        assert "path_not_allowed: " in text
        text = await call_error(
            client, "quantize_model", {"model": name, "calibration": "calib"}
        )  # the latest version is already quantized
        assert "quantiz" in text.lower()
        text = await call_error(
            client,
            "quantize_model",
            {"model": name, "version": 1, "calibration": "calib", "method": "nope"},
        )
        assert "invalid_argument: " in text


async def test_single_sample_says_metrics_are_on_calibration_data(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        calib = calibration_folder(sandbox.root / "one", [1, 3, 64, 64], 1)
        name = (await call(client, "open_model", {"path": "yolo.onnx"}))["model"]
        await call(client, "fix_model", {"model": name})
        q = await call(client, "quantize_model", {"model": name, "calibration": str(calib)})
    assert q["holdout_samples"] == 0 and q["holdout_is_calibration"]
    assert any("optimistic" in n for n in q["notes"])


async def test_compile_refuses_float_outside_workspace_and_overwrite(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        name, _ = await _quantized(client, sandbox)
        text = await call_error(
            client, "compile_model", {"model": name, "version": 1, "output_dir": "out"}
        )
        assert "not a quantized" in text
        for bad in (str(sandbox.outside), str(sandbox.workspace / "x")):
            text = await call_error(client, "compile_model", {"model": name, "output_dir": bad})
            assert "path_not_allowed: " in text, text
        first = await call(client, "compile_model", {"model": name, "output_dir": "out"})
        before = Path(first["archive"]).read_bytes()
        text = await call_error(client, "compile_model", {"model": name, "output_dir": "out"})
        assert "file_exists: " in text
        assert Path(first["archive"]).read_bytes() == before
        other = await call(
            client, "compile_model", {"model": name, "output_dir": "out", "name": "again"}
        )
        assert other["archive"].endswith("again_mpk.tar.gz") and other["elf_count"] == 1


def ran_args(compiled: dict, name: str) -> dict:
    """run_archive on in.npz, compared with the workspace model `name` (latest)."""
    return {
        "archive": compiled["archive"],
        "inputs": "in.npz",
        "compare_reference": True,
        "reference_model": name,
    }


async def test_run_archive_with_npz_inputs_and_workspace_reference(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        name, _ = await _quantized(client, sandbox)
        compiled = await call(client, "compile_model", {"model": name, "output_dir": "out"})
        rng = np.random.default_rng(3)
        np.savez(sandbox.root / "in.npz", images=rng.random((2, 3, 64, 64), dtype=np.float32))
        ran = await call(client, "run_archive", ran_args(compiled, name))
        assert ran["frames"] == 2 and ran["bit_exact"] is True
        assert ran["outputs"][0]["shape"][0] == 2 and ran["notes"] == []
        wrong = {**ran_args(compiled, name), "reference_version": "v1"}  # the float model
        text = await call_error(client, "run_archive", wrong)
        assert "is not the model this archive was compiled from" in text
        assert f"reference_version={compiled['version']!r}" in text, text
        plain = await call(client, "run_archive", {"archive": compiled["archive"], "seed": 1})
        assert plain["bit_exact"] is None and plain["outputs"][0]["bit_exact"] is None
        shutil.copy(sandbox.outside / "notes.txt", sandbox.outside / "in.npz")
        text = await call_error(
            client,
            "run_archive",
            {"archive": compiled["archive"], "inputs": str(sandbox.outside / "in.npz")},
        )
        assert "path_not_allowed: " in text
        text = await call_error(client, "inspect_archive", {"archive": "yolo.onnx"})
        assert "an ONNX model, not a compiled archive" in text and "compile_model" in text


async def test_run_archive_notes_an_input_it_casts(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        name, _ = await _quantized(client, sandbox)
        compiled = await call(client, "compile_model", {"model": name, "output_dir": "out"})
        np.savez(sandbox.root / "in.npz", images=np.zeros((1, 3, 64, 64), np.float64))
        ran = await call(
            client, "run_archive", {"archive": compiled["archive"], "inputs": "in.npz"}
        )
        assert ran["notes"] == ["input 'images' cast from float64 to float32"]


async def test_inspect_archive_pages_layers(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        name, _ = await _quantized(client, sandbox)
        compiled = await call(client, "compile_model", {"model": name, "output_dir": "out"})
        first = await call(client, "inspect_archive", {"archive": compiled["archive"], "limit": 3})
        assert first["layers_page"]["returned"] == 3
        nxt = first["layers_page"]["next_offset"]
        second = await call(
            client, "inspect_archive", {"archive": compiled["archive"], "limit": 3, "offset": nxt}
        )
        assert second["layers_page"]["offset"] == 3
        assert first["layers"][-1]["cycles"] >= second["layers"][0]["cycles"]


async def test_analyze_quantization_ranks_layers(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        name, _ = await _quantized(client, sandbox)
        held = calibration_folder(sandbox.root / "held", [1, 3, 64, 64], 2, seed=7)
        result = await call(
            client, "analyze_quantization", {"model": name, "data": str(held), "limit": 3}
        )
        assert result["float_version"] == "v1" and result["samples"] == 2
        assert result["layers"] and result["layers_page"]["returned"] <= 3
        # worst first by the layer's worst single-layer cosine (Concat slices included)
        cosines = [
            min([row["single"]["cosine"], *(p["cosine"] for p in row["single_parts"].values())])
            for row in result["layers"]
        ]
        assert cosines == sorted(cosines)
        assert result["outputs"]
        text = await call_error(client, "analyze_quantization", {"model": name, "data": "nope"})
        assert "nope" in text


async def test_analyze_quantization_reads_samples_as_quantize_did(sandbox: Sandbox) -> None:
    """Without mean/std of its own, analysis takes the preprocessing quantize recorded."""
    async with Client(sandbox.server()) as client:
        calibration_folder(sandbox.root / "calib", [1, 3, 64, 64], 3)
        name = (await call(client, "open_model", {"path": "yolo.onnx"}))["model"]
        await call(client, "fix_model", {"model": name})
        prep = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
        await call(client, "quantize_model", {"model": name, "calibration": "calib", **prep})
        result = await call(client, "analyze_quantization", {"model": name, "data": "calib"})
        own = await call(
            client, "analyze_quantization", {"model": name, "data": "calib", "bgr": True}
        )
    assert {k: result["preprocessing"][k] for k in prep} == prep
    assert own["preprocessing"]["bgr"] is True and own["preprocessing"]["mean"] == prep["mean"]


async def test_quantize_with_sqnr_target_raises_layers_and_still_compiles_bit_exact(
    sandbox: Sandbox,
) -> None:
    async with Client(sandbox.server()) as client:
        calib = calibration_folder(sandbox.root / "calib", [1, 3, 64, 64], 4)
        name = (await call(client, "open_model", {"path": "yolo.onnx"}))["model"]
        await call(client, "fix_model", {"model": name})
        plain = await call(
            client, "quantize_model", {"model": name, "calibration": str(calib), "holdout": 1}
        )
        hybrid = await call(
            client,
            "quantize_model",
            {
                "model": name,
                "version": plain["parent"],
                "calibration": str(calib),
                "holdout": 1,
                "target_sqnr_db": 60,
            },
        )
        compiled = await call(client, "compile_model", {"model": name, "output_dir": "build"})
        ran = await call(
            client, "run_archive", {"archive": compiled["archive"], "compare_reference": True}
        )
    assert plain["hybrid_raised"] == [] and plain["hybrid_converged"] is None
    assert hybrid["hybrid_raised"] and isinstance(hybrid["hybrid_converged"], bool)
    said = "target 60 dB reached" if hybrid["hybrid_converged"] else "target 60 dB not reached"
    assert any(note.startswith(said) for note in hybrid["notes"])
    assert float(hybrid["worst_sqnr_db"]) > float(plain["worst_sqnr_db"])
    assert compiled["version"] == hybrid["version"]
    assert ran["outputs"] and all(o["bit_exact"] for o in ran["outputs"])


async def test_quantize_notes_what_to_try_when_an_output_loses_its_signal(
    sandbox: Sandbox,
) -> None:
    from tests.test_quant_hybrid import collapsing_head

    save_model(collapsing_head(), sandbox.root / "head.onnx")
    async with Client(sandbox.server()) as client:
        calib = calibration_folder(sandbox.root / "head_calib", [1, 3, 8, 8], 4)
        name = (await call(client, "open_model", {"path": "head.onnx"}))["model"]
        q = await call(
            client,
            "quantize_model",
            {"model": name, "calibration": str(calib), "holdout": 1, "method": "minmax"},
        )
    assert float(q["worst_sqnr_db"]) < 20
    assert any("'scores'" in n and "dB" in n for n in q["notes"])
    assert any("target_sqnr_db=30" in n for n in q["notes"])
    assert any(f"analyze_quantization on {name} {q['version']}" in n for n in q["notes"])


async def test_quantize_reports_the_parts_of_a_concatenated_output(sandbox: Sandbox) -> None:
    """Boxes ‖ scores in one output: the whole looks fine while the scores part collapses,
    and only auto_hybrid (which judges each part) is advised."""
    from tests.test_quant_concat_output import detector_output

    save_model(detector_output(), sandbox.root / "det.onnx")
    async with Client(sandbox.server()) as client:
        calib = calibration_folder(sandbox.root / "det_calib", [1, 3, 8, 8], 6)
        name = (await call(client, "open_model", {"path": "det.onnx"}))["model"]
        q = await call(client, "quantize_model", {"model": name, "calibration": str(calib)})
    (output,) = q["outputs"]
    assert float(output["sqnr_db"]) > 20
    assert min(float(p["sqnr_db"]) for p in output["parts"].values()) < 20
    assert any("auto_hybrid=0.98" in n for n in q["notes"])
