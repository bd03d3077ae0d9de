"""`check` on the real third-party models in ../shared/models (skipped when absent)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from server.cli import app
from surgery.check import check_model
from tests.conftest import RUN_INPUTS, SHARED_MODELS, shared_model

MODELS = sorted(p.stem for p in SHARED_MODELS.glob("*.onnx")) or ["yolov8n"]


@pytest.mark.parametrize("name", MODELS)
def test_check_runs_and_counts_are_consistent(name):
    report = check_model(shared_model(name), "mlsoc", input_shapes=RUN_INPUTS.get(name))
    data = report.to_dict()
    assert sum(data["processors"].values()) == data["nodes_total"]
    assert data["mla_segments"] == len(data["segments"])
    segment_nodes = sum(s["node_count"] for s in data["segments"])
    assert segment_nodes == data["processors"]["MLA"]
    assert 0.0 <= data["mla_mac_fraction"] <= 1.0
    for blocker in data["blockers"]:
        assert blocker["reasons"], f"{blocker['node']} is blocked without a reason"


def test_yolov8n_head_reshape_concat_are_rank_blockers():
    result = CliRunner().invoke(app, ["check", str(shared_model("yolov8n")), "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 1 and data["mla_segments"] == 2
    by_op = {}
    for b in data["blockers"]:
        by_op.setdefault(b["op_type"], []).append(b)
    assert {"Reshape", "Concat"} <= set(by_op)
    assert all("rank 3" in b["reasons"][0] for b in by_op["Concat"])


def test_mobilenet_v2_is_a_single_segment():
    result = CliRunner().invoke(app, ["check", str(shared_model("mobilenet_v2"))])
    assert result.exit_code == 0


def test_silero_vad_control_flow_stays_off_the_mla():
    report = check_model(shared_model("silero_vad"), "mlsoc", input_shapes=RUN_INPUTS["silero_vad"])
    assert report.mla_segments == 0
    assert any(b.op_type == "If" for b in report.blockers)


def test_paddle_constant_nodes_fold_instead_of_blocking():
    report = check_model(
        shared_model("ppocrv4_det"), "mlsoc", input_shapes=RUN_INPUTS["ppocrv4_det"]
    )
    constants = [p for p in report.placements if p.op_type == "Constant"]
    assert constants and all(p.foldable for p in constants)
    assert report.single_elf
