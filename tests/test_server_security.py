"""Abuse: paths out of the allowed roots, broken models, floods of malformed calls. The server
must refuse with a clear message, keep answering, and change no file it was not asked to."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from mcp import Client

from server.paths import PathNotAllowedError, PathPolicy
from tests.test_server_common import (  # noqa: F401  (fixtures)
    Sandbox,
    anyio_backend_fixture,
    call,
    call_error,
    sandbox_fixture,
    tree_digest,
)

pytestmark = pytest.mark.anyio


def _escapes(sandbox: Sandbox) -> list[tuple[str, str]]:
    """(path as the client sends it, words the refusal must contain)."""
    (sandbox.root / "link.onnx").symlink_to(sandbox.outside / "secret.onnx")
    (sandbox.root / "linkdir").symlink_to(sandbox.outside, target_is_directory=True)
    return [
        ("../outside/secret.onnx", "'..'"),
        ("sub/../../outside/secret.onnx", "'..'"),
        (str(sandbox.outside / "secret.onnx"), "outside the allowed roots"),
        ("/etc/passwd", "outside the allowed roots"),
        ("link.onnx", "through a symbolic link"),
        ("linkdir/secret.onnx", "through a symbolic link"),
        ("", "empty path"),
        ("cnn.onnx\x00.txt", "NUL"),
    ]


async def test_read_paths_are_confined(sandbox: Sandbox) -> None:
    escapes = _escapes(sandbox)
    async with Client(sandbox.server()) as client:
        for raw, words in escapes:
            for tool in ("open_model", "validate_model"):
                text = await call_error(client, tool, {"path": raw})
                refused = "path_not_allowed" in text and words in text
                too_short = raw == "" and "at least 1 character" in text  # schema-level refusal
                assert refused or too_short, (tool, raw, text)
        listed = (await client.read_resource("surgery://models")).contents[0].text
    assert '"models": []' in listed


async def test_write_paths_are_confined(sandbox: Sandbox) -> None:
    _escapes(sandbox)
    before = tree_digest(sandbox.outside)
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        cases = {
            "../outside/out.onnx": "'..'",
            str(sandbox.outside / "out.onnx"): "outside the allowed roots",
            "linkdir/out.onnx": "through a symbolic link",
            "link.onnx": "through a symbolic link",
            ".surgery/models/cnn/v0000.onnx": "inside the workspace",
            "notes.txt": "only .onnx files",
            "cnn.onnx/out.onnx": "is a file, not a folder",
        }
        for raw, words in cases.items():
            text = await call_error(
                client, "export_model", {"model": "cnn", "path": raw, "overwrite": True}
            )
            assert words in text, (raw, text)
    assert tree_digest(sandbox.outside) == before


async def test_export_creates_missing_folders_inside_a_root(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        out = await call(client, "export_model", {"model": "cnn", "path": "new/sub/cnn.onnx"})
    assert Path(out["path"]) == (sandbox.root / "new" / "sub" / "cnn.onnx").resolve()
    assert Path(out["path"]).is_file()


async def test_rule_file_parameters_are_confined(sandbox: Sandbox) -> None:
    """cut-postprocess's `post` is a file the rule writes: the same policy as export_model."""
    _escapes(sandbox)
    before = tree_digest(sandbox.outside)
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "yolo.onnx"})
        stored = sandbox.workspace / "models" / "yolo" / "v0000.onnx"
        original = stored.read_bytes()
        cases = {
            str(sandbox.outside / "post.onnx"): "outside the allowed roots",
            "../outside/post.onnx": "'..'",
            "linkdir/post.onnx": "through a symbolic link",
            ".surgery/models/yolo/v0000.onnx": "inside the workspace",
            "yolo.onnx": "already exists",
        }
        for raw, words in cases.items():
            args = {"model": "yolo", "rule": "cut-postprocess", "params": {"post": raw}}
            text = await call_error(client, "apply_rule", args)
            assert words in text, (raw, text)
        assert stored.read_bytes() == original
        versions = await call(client, "history", {"model": "yolo"})
    assert tree_digest(sandbox.outside) == before
    assert len(versions["versions"]) == 1  # nothing was stored by the refused calls


def test_policy_accepts_paths_inside(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m.onnx").write_bytes(b"x")
    (tmp_path / "a" / "inner").symlink_to(tmp_path / "a", target_is_directory=True)
    policy = PathPolicy([tmp_path / "a"])
    assert policy.resolve("m.onnx") == (tmp_path / "a" / "m.onnx").resolve()
    assert policy.resolve(str(tmp_path / "a" / "m.onnx")).name == "m.onnx"
    assert policy.resolve("inner/m.onnx").name == "m.onnx"  # a symlink that stays inside is fine
    with pytest.raises(PathNotAllowedError, match="not an existing folder"):
        PathPolicy([tmp_path / "nope"])


@pytest.mark.parametrize(
    ("file", "words"),
    [
        ("corrupt.onnx", "not_onnx"),
        ("truncated.onnx", "not_onnx"),
        ("empty.onnx", "not_onnx"),
        ("cyclic.onnx", "cycle"),
        ("missing.onnx", "missing initializer"),
    ],
)
async def test_broken_models_are_refused_clearly(sandbox: Sandbox, file: str, words: str) -> None:
    async with Client(sandbox.server()) as client:
        text = await call_error(client, "open_model", {"path": file})
        assert words in text, text
        assert (await call(client, "list_targets"))["targets"]  # still answering
    assert not (sandbox.workspace / "models").exists() or not any(
        (sandbox.workspace / "models").iterdir()
    )


def _malformed_calls(rng: random.Random) -> list[tuple[str, object]]:
    junk = [
        None,
        1,
        -5,
        3.5,
        True,
        "",
        "x" * 10_000,
        "\x00",
        [],
        [1, [2, [3]]],
        {"a": {"b": None}},
        "../../etc/passwd",
        "v-1",
        "latest; rm -rf /",
        "/[unclosed/",
        "*",
    ]
    tools = [
        "open_model",
        "model_summary",
        "inspect_node",
        "find_nodes",
        "check_model",
        "explain_op",
        "suggest_rules",
        "apply_rule",
        "fix_model",
        "verify_models",
        "validate_model",
        "history",
        "revert",
        "diff_versions",
        "export_model",
        "no_such_tool",
    ]
    keys = ["version", "path", "node", "rule", "target", "limit", "params", "a", "op", "pattern"]
    calls = []
    for _ in range(200):
        args = {rng.choice(keys): rng.choice(junk) for _ in range(rng.randint(0, 4))}
        if rng.random() < 0.5:
            args["model"] = "cnn"  # get past the lookup so the junk reaches deeper code
        if rng.random() < 0.1:
            args = rng.choice(junk)  # not even an object
        calls.append((rng.choice(tools), args))
    return calls


async def test_two_hundred_malformed_calls_then_still_answering(sandbox: Sandbox) -> None:
    before_outside = tree_digest(sandbox.outside)
    before_inputs = {
        name: digest
        for name, digest in tree_digest(sandbox.root).items()
        if not name.startswith(".surgery")
    }
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        crashes = []
        for tool, args in _malformed_calls(random.Random(6)):
            try:
                result = await client.call_tool(
                    tool, args if isinstance(args, dict) else {"x": args}
                )
            except Exception as exc:  # a protocol-level rejection is fine, a dead server is not
                crashes.append((tool, repr(exc)[:200]))
                continue
            if result.is_error and "internal_error" in result.content[0].text:
                crashes.append((tool, result.content[0].text[:200]))
        assert crashes == []
        check = await call(client, "check_model", {"model": "cnn", "version": "v0"})
        assert check["mla_segments"] == 2
    assert tree_digest(sandbox.outside) == before_outside
    after_inputs = {
        name: digest
        for name, digest in tree_digest(sandbox.root).items()
        if not name.startswith(".surgery")
    }
    assert after_inputs == before_inputs


async def test_user_files_never_modified_by_edits(sandbox: Sandbox) -> None:
    source = sandbox.root / "cnn.onnx"
    digest = tree_digest(sandbox.root)["cnn.onnx"]
    mtime = os.stat(source).st_mtime_ns
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        await call(client, "apply_rule", {"model": "cnn", "rule": "remove-identity"})
        await call(client, "fix_model", {"model": "cnn", "version": "v0"})
        await call(client, "revert", {"model": "cnn", "version": "v0"})
    assert tree_digest(sandbox.root)["cnn.onnx"] == digest
    assert os.stat(source).st_mtime_ns == mtime
