"""Shared helpers for the MCP server tests: a sandbox with models, a server, a call helper.

Imported by the other test_server_* modules (fixtures by their `*_fixture` function names, so
the import is not shadowed by the test parameters); it holds no tests itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import pytest
from mcp import Client
from onnx import TensorProto, helper

from server.app import create_server
from surgery import examples
from surgery.model import save_model


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"


def cnn_with_noop_cast() -> onnx.ModelProto:
    """plain_cnn with a float->float Cast in the middle: the Cast runs on the CVU, so the model
    maps to two MLA segments until remove-identity removes it."""
    model = examples.plain_cnn()
    g = model.graph
    first_relu = next(n for n in g.node if n.op_type == "Relu")
    out = first_relu.output[0]
    consumers = [n for n in g.node if out in n.input]
    for n in consumers:
        n.input[list(n.input).index(out)] = "cast_out"
    idx = list(g.node).index(first_relu)
    cast = helper.make_node("Cast", [out], ["cast_out"], name="extra_cast", to=TensorProto.FLOAT)
    g.node.insert(idx + 1, cast)
    return model


def cyclic_model() -> onnx.ModelProto:
    a = helper.make_node("Relu", ["b_out"], ["a_out"], name="a")
    b = helper.make_node("Add", ["x", "a_out"], ["b_out"], name="b")
    graph = helper.make_graph(
        [a, b],
        "cyclic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("b_out", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def missing_initializer_model() -> onnx.ModelProto:
    node = helper.make_node("Add", ["x", "w"], ["y"], name="add")
    graph = helper.make_graph(
        [node],
        "missing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@dataclass
class Sandbox:
    root: Path
    workspace: Path
    outside: Path

    def server(self):
        return create_server(self.workspace, [self.root])


@pytest.fixture(name="sandbox")
def sandbox_fixture(tmp_path: Path) -> Sandbox:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    save_model(cnn_with_noop_cast(), root / "cnn.onnx")
    save_model(examples.yolo_head(), root / "yolo.onnx")
    save_model(examples.plain_cnn(), root / "plain.onnx")
    save_model(cyclic_model(), root / "cyclic.onnx")
    save_model(missing_initializer_model(), root / "missing.onnx")
    good = (root / "cnn.onnx").read_bytes()
    (root / "truncated.onnx").write_bytes(good[: len(good) // 2])
    (root / "corrupt.onnx").write_bytes(b"\x08\x07garbage\xff\xfe" * 50)
    (root / "empty.onnx").write_bytes(b"")
    save_model(examples.plain_cnn(), outside / "secret.onnx")
    (outside / "notes.txt").write_text("not yours")
    return Sandbox(root=root, workspace=root / ".surgery", outside=outside)


async def call(client: Client, name: str, args: dict[str, Any] | None = None, **kw: Any) -> dict:
    """Call a tool that must succeed; return its structured content."""
    result = await client.call_tool(name, args or {}, **kw)
    text = result.content[0].text if result.content else ""
    assert not result.is_error, f"{name} failed: {text}"
    assert result.structured_content is not None, f"{name} returned no structured content"
    return result.structured_content


async def call_error(client: Client, name: str, args: dict[str, Any] | None = None) -> str:
    """Call a tool that must fail cleanly; return the error text the client sees."""
    result = await client.call_tool(name, args or {})
    assert result.is_error, f"{name} unexpectedly succeeded: {result.structured_content}"
    text = result.content[0].text
    assert "internal_error" not in text, f"{name} crashed instead of refusing: {text}"
    return text


def tree_digest(folder: Path) -> dict[str, str]:
    """Path -> sha256 of every file under a folder (to prove nothing changed)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True)
