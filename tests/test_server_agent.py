"""An agent's session on a real detector, through MCP calls only, counting the calls.

open -> check -> suggest_rules -> fix_model -> verify (end to end) -> check. The count is what an
agent pays to get from a file to a verified, re-checked result; it is printed for the report.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from server.app import create_server
from tests.conftest import shared_model
from tests.test_server_common import anyio_backend_fixture  # noqa: F401  (fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


class CountingAgent:
    """Calls tools through one client and keeps the tally an agent transcript would show."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.calls: Counter[str] = Counter()
        self.progress: list[str] = []

    async def __call__(self, tool: str, **args: Any) -> dict:
        self.calls[tool] += 1

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            self.progress.append(message or "")

        result = await self.client.call_tool(tool, args, progress_callback=on_progress)
        assert not result.is_error, f"{tool}: {result.content[0].text}"
        return result.structured_content

    @property
    def total(self) -> int:
        return sum(self.calls.values())


async def test_agent_makes_yolov8n_better_through_mcp_only(tmp_path: Path) -> None:
    source = shared_model("yolov8n")
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(source, root / "yolov8n.onnx")
    before = (root / "yolov8n.onnx").read_bytes()

    async with Client(create_server(root / ".surgery", [root])) as client:
        agent = CountingAgent(client)
        opened = await agent("open_model", path="yolov8n.onnx")
        name = opened["model"]
        first = await agent("check_model", model=name, target="mlsoc", limit=5)
        final = first
        if not first["single_elf"]:
            suggested = await agent("suggest_rules", model=name, target="mlsoc")
            if suggested["rules"]:
                fixed = await agent("fix_model", model=name, target="mlsoc")
                assert fixed["mla_segments_before"] == first["mla_segments"]
                if fixed["changed"]:
                    verified = await agent("verify_models", model=name, reference_version="v0")
                    assert verified["passed"], verified["failed_outputs"]
            final = await agent("check_model", model=name, target="mlsoc", limit=5)

    assert final["mla_segments"] <= first["mla_segments"]
    assert (root / "yolov8n.onnx").read_bytes() == before
    assert agent.total <= 6
    print(
        f"\nagent scenario (yolov8n, mlsoc): {agent.total} tool calls {dict(agent.calls)}; "
        f"segments {first['mla_segments']} -> {final['mla_segments']}, blockers "
        f"{first['blockers_page']['total']} -> {final['blockers_page']['total']}; "
        f"{len(agent.progress)} progress notifications"
    )
