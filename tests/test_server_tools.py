"""Every MCP tool through the in-memory client: schemas, structured results, annotations,
progress, resources, the prompt, and clear errors."""

from __future__ import annotations

import shutil
from importlib.util import find_spec

import anyio
import onnx
import pytest
from mcp import Client

from surgery import examples
from surgery.model import save_model
from tests.conftest import shared_model
from tests.test_fix_qdq import qdq_linear_model
from tests.test_server_common import (  # noqa: F401  (fixtures)
    Sandbox,
    anyio_backend_fixture,
    call,
    call_error,
    sandbox_fixture,
)

pytestmark = pytest.mark.anyio

READ_ONLY = {
    "model_summary",
    "inspect_node",
    "find_nodes",
    "validate_model",
    "check_model",
    "list_targets",
    "explain_op",
    "list_rules",
    "suggest_rules",
    "history",
    "diff_versions",
    "verify_models",
    "inspect_archive",
    "run_archive",
    "analyze_quantization",
}
WRITING = {
    "open_model",
    "apply_rule",
    "fix_model",
    "revert",
    "export_model",
    "quantize_model",
    "compile_model",
}
IDEMPOTENT_WRITERS = {"open_model", "export_model"}
EDIT_TOOLS = {"edit_graph", "split_model", "merge_models"}
HAS_EDIT = find_spec("surgery.edit") is not None and find_spec("surgery.split") is not None


async def test_every_tool_has_schemas_and_truthful_annotations(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == READ_ONLY | WRITING | (EDIT_TOOLS if HAS_EDIT else set())
    for name, tool in tools.items():
        assert tool.description and len(tool.description) > 20, name
        assert tool.input_schema["type"] == "object", name
        assert tool.output_schema and tool.output_schema.get("properties"), name
        a = tool.annotations
        assert a is not None and a.title, name
        assert a.open_world_hint is False, name
        assert a.read_only_hint is (name in READ_ONLY), name  # every other tool writes
        assert a.idempotent_hint is (name in READ_ONLY | IDEMPOTENT_WRITERS), name
        assert a.destructive_hint is (name == "export_model"), name
    assert "path" in tools["open_model"].input_schema["required"]
    assert {"version", "nodes_added", "verify", "coverage"} <= set(
        tools["apply_rule"].output_schema["properties"]
    )


async def test_open_summary_find_inspect(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        opened = await call(client, "open_model", {"path": "cnn.onnx"})
        assert (opened["model"], opened["version"], opened["created"]) == ("cnn", "v0", True)
        assert opened["summary"]["inputs"][0]["shape"] == [1, 3, 32, 32]
        again = await call(client, "open_model", {"path": str(sandbox.root / "cnn.onnx")})
        assert (again["version"], again["created"]) == ("v0", False)

        summary = await call(client, "model_summary", {"model": "cnn", "top_ops": 2})
        assert len(summary["op_histogram"]) == 2 and summary["other_op_types"] > 0

        first = await call(client, "find_nodes", {"model": "cnn", "limit": 3})
        assert first["page"]["returned"] == 3 and first["page"]["next_offset"] == 3
        rest = await call(client, "find_nodes", {"model": "cnn", "limit": 100, "offset": 3})
        assert rest["page"]["next_offset"] is None
        assert rest["page"]["total"] == first["page"]["total"] == 3 + rest["page"]["returned"]
        casts = await call(client, "find_nodes", {"model": "cnn", "op_type": "Cast"})
        assert [n["name"] for n in casts["nodes"]] == ["extra_cast"]

        node = await call(client, "inspect_node", {"model": "cnn", "node": "extra_cast", "hops": 1})
        assert node["node"]["op_type"] == "Cast"
        assert node["node"]["inputs"][0]["shape"] == [1, 8, 16, 16]
        assert {n["distance"] for n in node["neighbourhood"]} == {0, 1}


async def test_open_model_refuses_another_file_under_an_existing_name(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        text = await call_error(client, "open_model", {"path": "yolo.onnx", "name": "cnn"})
        assert "model 'cnn' already exists" in text and "another file" in text, text
        history = await call(client, "history", {"model": "cnn"})
    assert len(history["versions"]) == 1


async def test_open_model_adds_a_version_when_the_same_file_changed(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        save_model(examples.plain_cnn(), sandbox.root / "cnn.onnx")  # edited outside
        again = await call(client, "open_model", {"path": "cnn.onnx"})
    assert (again["model"], again["version"], again["created"]) == ("cnn", "v1", True)


def _group_counts(result: dict) -> list[tuple[str, int]]:
    return sorted((g["code"], g["count"]) for g in result["blocker_groups"])


async def test_a_misspelt_argument_is_refused_not_ignored(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        text = await call_error(client, "check_model", {"model": "cnn", "limt": 5})
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert "`limt` is not an argument of check_model (did you mean `limit`?)" in text
    assert "hint: check_model takes model, version, target" in text
    assert tools["check_model"].input_schema.get("additionalProperties") is False


async def test_a_wrongly_typed_argument_is_named_with_the_value_given(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        text = await call_error(client, "fix_model", {"model": "cnn", "max_steps": "many"})
    assert "invalid_argument: `max_steps`: Input should be a valid integer" in text
    assert "(got 'many')" in text and "errors.pydantic.dev" not in text


async def test_a_missing_argument_is_named_as_required(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        text = await call_error(client, "check_model", {})
    assert "invalid_argument: `model` is required" in text


async def test_suggest_rules_counts_what_check_model_counts(sandbox: Sandbox) -> None:
    """bert_tiny's shapes wait for folding: both tools read them folded (suggest_rules used
    to report dynamic-shape blockers that check_model does not)."""
    shutil.copy(shared_model("bert_tiny"), sandbox.root / "bert.onnx")
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "bert.onnx"})
        check = await call(client, "check_model", {"model": "bert"})
        suggest = await call(client, "suggest_rules", {"model": "bert"})
    assert suggest["mla_segments"] == check["mla_segments"]
    assert _group_counts(suggest) == _group_counts(check)
    assert not any(g["code"] == "dynamic_shape" for g in suggest["blocker_groups"])


async def test_suggest_rules_on_a_quantized_model_reads_its_float_model(sandbox: Sandbox) -> None:
    save_model(qdq_linear_model(), sandbox.root / "qdq.onnx")
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "qdq.onnx"})
        check = await call(client, "check_model", {"model": "qdq"})
        suggest = await call(client, "suggest_rules", {"model": "qdq"})
    assert suggest["mla_segments"] == check["mla_segments"]
    assert not any("QuantizeLinear" in g["op_types"] for g in suggest["blocker_groups"])
    assert suggest["notes"] and "quantize" in suggest["notes"][0]


async def test_cut_postprocess_stores_the_tail_as_its_own_model(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "yolo.onnx"})
        cut = await call(client, "apply_rule", {"model": "yolo", "rule": "cut-postprocess"})
        assert any("'yolo_post' v0" in note for note in cut["notes"]), cut["notes"]
        post = await call(client, "model_summary", {"model": "yolo_post"})
        body = await call(client, "model_summary", {"model": "yolo", "version": cut["version"]})
    assert [o["name"] for o in post["outputs"]] == ["output0"]
    assert {i["name"] for i in post["inputs"]} == {o["name"] for o in body["outputs"]}


async def test_check_suggest_apply_verify_history_diff_revert_export(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        check = await call(client, "check_model", {"model": "cnn", "limit": 1})
        assert check["mla_segments"] == 2 and not check["single_elf"]
        assert check["blockers"][0]["node"] == "extra_cast"
        assert check["blockers_page"]["total"] == 1
        assert check["blocker_groups"][0]["suggested_rules"] == ["remove-identity"]

        suggest = await call(client, "suggest_rules", {"model": "cnn"})
        assert suggest["rules"][0]["rule"] == "remove-identity"
        assert suggest["rules"][0]["blockers_removed"] == 1
        assert suggest["blocker_groups"][0]["suggested_rules"] == ["remove-identity"]
        assert suggest["unaddressed_blockers"] == 0

        applied = await call(client, "apply_rule", {"model": "cnn", "rule": "remove-identity"})
        assert (applied["version"], applied["parent"], applied["changed"]) == ("v1", "v0", True)
        assert applied["nodes_removed"] == ["extra_cast"] and applied["nodes_removed_count"] == 1
        assert applied["verify"]["passed"] and applied["verify"]["mode"] == "exact"
        assert applied["mla_segments_before"] == 2
        assert applied["coverage"]["mla_segments"] == 1 and applied["coverage"]["single_elf"]

        verified = await call(client, "verify_models", {"model": "cnn"})
        assert verified["passed"] and verified["reference"]["version"] == "v0"
        assert verified["outputs"][0]["name"] == "logits"

        history = await call(client, "history", {"model": "cnn"})
        assert [v["version"] for v in history["versions"]] == ["v1", "v0"]
        assert history["versions"][0]["action"] == "rule:remove-identity"
        assert history["versions"][0]["verify"]["passed"]

        diff = await call(client, "diff_versions", {"model": "cnn", "a": "v0", "b": 1})
        assert [n["key"] for n in diff["nodes_removed"]] == ["extra_cast"]
        assert diff["counts"]["nodes_removed"] == 1 and not diff["identical"]

        reverted = await call(client, "revert", {"model": "cnn", "version": "v0"})
        assert reverted["version"] == "v2" and reverted["nodes_added"] == ["extra_cast"]
        assert reverted["coverage"]["mla_segments"] == 2 and reverted["verify"] is None

        exported = await call(
            client, "export_model", {"model": "cnn", "version": "v1", "path": "cnn_fixed.onnx"}
        )
        written = onnx.load(exported["path"])
        assert "extra_cast" not in {n.name for n in written.graph.node}
        refused = await call_error(
            client, "export_model", {"model": "cnn", "path": "cnn_fixed.onnx"}
        )
        assert "file_exists" in refused and "overwrite" in refused
        again = await call(
            client,
            "export_model",
            {"model": "cnn", "path": "cnn_fixed.onnx", "overwrite": True, "version": "v0"},
        )
        assert again["sha256"] != exported["sha256"]


async def test_fix_model_reports_progress(sandbox: Sandbox) -> None:
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, total, message))

    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        fixed = await call(client, "fix_model", {"model": "cnn"}, progress_callback=on_progress)
    assert fixed["version"] == "v1" and fixed["changed"] and fixed["action"] == "fix"
    assert [s["rule"] for s in fixed["steps"]] == ["remove-identity"]
    assert fixed["coverage"]["single_elf"] and fixed["mla_segments_before"] == 2
    assert fixed["verify"]["passed"] and fixed["nodes_removed"] == ["extra_cast"]
    values = [p[0] for p in progress]
    assert len(progress) >= 3 and values == sorted(values)
    assert any("remove-identity" in (p[2] or "") for p in progress)


async def test_fix_without_improvement_adds_no_version(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "plain.onnx"})
        fixed = await call(client, "fix_model", {"model": "plain", "max_steps": 3})
        history = await call(client, "history", {"model": "plain"})
    assert not fixed["changed"] and fixed["version"] == "v0"
    assert any("already one MLA segment: nothing to fix" in n for n in fixed["notes"])
    assert history["page"]["total"] == 1


async def test_catalogue_tools(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        rules = await call(client, "list_rules")
        names = {r["name"] for r in rules["rules"]}
        assert {"fold-constants", "remove-identity"} <= names
        assert all(r.get("doc") is None for r in rules["rules"])  # brief by default
        cleanup = await call(client, "list_rules", {"category": "cleanup"})
        assert all(r["category"] == "cleanup" for r in cleanup["rules"])
        (cut,) = (await call(client, "list_rules", {"name": "cut-postprocess"}))["rules"]
        assert "post" in cut["params"] and cut["doc"]
        typo = await call_error(client, "list_rules", {"name": "fold_constants"})
        assert "did you mean fold-constants?" in typo
        await call_error(client, "list_rules", {"category": "bogus"})
        targets = await call(client, "list_targets")
        assert {"mlsoc", "modalix", "rk3588"} <= {t["name"] for t in targets["targets"]}
        assert targets["default"] == "mlsoc"
        resize = await call(client, "explain_op", {"op": "Resize", "target": "rk3588"})
        assert resize["target"] == "rk3588" and resize["placements"]
        absent = await call(client, "explain_op", {"op": "NonMaxSuppression"})
        assert not absent["in_table"] and not absent["on_mla"]
        unknown = await call_error(client, "explain_op", {"op": "reshape"})
        assert "unknown op 'reshape'" in unknown and "did you mean Reshape?" in unknown


async def test_validate_model(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        ok = await call(client, "validate_model", {"path": "cnn.onnx"})
        assert ok["valid"] and ok["problems"] == [] and ok["opset"] == 17
        cyclic = await call(client, "validate_model", {"path": "cyclic.onnx"})
        assert not cyclic["valid"] and cyclic["problems"][0]["code"] == "invalid_graph"
        assert "cycle" in cyclic["problems"][0]["message"]
        missing = await call(client, "validate_model", {"path": "missing.onnx"})
        assert "missing initializer" in missing["problems"][0]["message"]
        await call(client, "open_model", {"path": "cnn.onnx"})
        by_name = await call(client, "validate_model", {"model": "cnn"})
        assert by_name["valid"] and by_name["source"] == "cnn v0"
        both = await call_error(client, "validate_model", {"model": "cnn", "path": "cnn.onnx"})
        assert "exactly one" in both


async def test_validate_model_reports_an_element_type_onnx_does_not_define(
    sandbox: Sandbox,
) -> None:
    """onnx's checker raises a ValueError for it, which the tool reported as an internal error."""
    model = examples.plain_cnn()
    model.graph.initializer[0].data_type = 99
    save_model(model, sandbox.root / "type99.onnx")
    async with Client(sandbox.server()) as client:
        result = await call(client, "validate_model", {"path": "type99.onnx"})
    assert not result["valid"]
    assert result["problems"][0]["code"] == "checker"
    assert "Invalid tensor data type 99" in result["problems"][0]["message"]


@pytest.mark.parametrize(
    ("tool", "args", "expected"),
    [
        ("model_summary", {"model": "nope"}, "no model 'nope'"),
        ("model_summary", {"model": "cnn", "version": "v9"}, "has no version v9"),
        ("model_summary", {"model": "cnn", "version": "banana"}, "invalid version"),
        ("inspect_node", {"model": "cnn", "node": "no_such"}, "node_not_found"),
        ("check_model", {"model": "cnn", "target": "tpu9000"}, "unknown target"),
        ("apply_rule", {"model": "cnn", "rule": "make-it-fast"}, "unknown rule"),
        ("apply_rule", {"model": "cnn", "rule": "fold-constants"}, "does not apply"),
        (
            "apply_rule",
            {"model": "cnn", "rule": "remove-identity", "params": {"bogus": 1}},
            "bad_rule_params",
        ),
        ("find_nodes", {"model": "cnn", "limit": 0}, "limit"),
        ("open_model", {"path": "cnn.onnx", "name": "../evil"}, "invalid model name"),
        ("open_model", {"path": "nothere.onnx"}, "no such file"),
        ("verify_models", {"model": "cnn"}, "has no parent"),
        ("diff_versions", {"model": "cnn", "a": -1}, "invalid version"),
        ("explain_op", {}, "op"),
    ],
)
async def test_errors_are_clear(sandbox: Sandbox, tool: str, args: dict, expected: str) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        text = await call_error(client, tool, args)
    assert expected in text, text


async def test_unknown_tool_is_an_error(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        result = await client.call_tool("format_disk", {})
    assert result.is_error and "Unknown tool" in result.content[0].text


async def test_resources_and_prompt(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        listed = {str(r.uri) for r in (await client.list_resources()).resources}
        assert {"surgery://models", "surgery://rules", "surgery://targets"} <= listed
        templates = {
            t.uri_template for t in (await client.list_resource_templates()).resource_templates
        }
        assert {
            "surgery://models/{name}/{version}/summary",
            "surgery://targets/{name}",
        } <= templates

        models = (await client.read_resource("surgery://models")).contents[0]
        assert '"name": "cnn"' in models.text and models.mime_type == "application/json"
        summary = (await client.read_resource("surgery://models/cnn/v0/summary")).contents[0]
        assert '"graph_name": "plain_cnn"' in summary.text
        table = (await client.read_resource("surgery://targets/mlsoc")).contents[0]
        assert table.mime_type == "text/markdown" and "| Conv |" in table.text
        rules = (await client.read_resource("surgery://rules")).contents[0]
        assert "`remove-identity`" in rules.text
        with pytest.raises(Exception, match="no model 'ghost'"):
            await client.read_resource("surgery://models/ghost/v0/summary")

        prompts = (await client.list_prompts()).prompts
        assert [p.name for p in prompts] == ["make_single_elf"]
        prompt = await client.get_prompt(
            "make_single_elf", {"model_path": "models/yolov8n.onnx", "target": "modalix"}
        )
        text = prompt.messages[0].content.text
        assert 'open_model(path="models/yolov8n.onnx")' in text and 'target="modalix"' in text


async def test_concurrent_calls_share_state_safely(sandbox: Sandbox) -> None:
    """Parallel reads and writes from one client: unique versions, consistent answers."""
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        results: list[dict] = []

        async def run(tool: str, args: dict) -> None:
            results.append({"tool": tool, **await call(client, tool, args)})

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(
                    run, "apply_rule", {"model": "cnn", "rule": "remove-identity", "version": "v0"}
                )
                tg.start_soon(run, "check_model", {"model": "cnn", "version": "v0"})
                tg.start_soon(
                    run, "inspect_node", {"model": "cnn", "node": "extra_cast", "version": "v0"}
                )
        history = await call(client, "history", {"model": "cnn"})
    versions = sorted(r["version"] for r in results if r["tool"] == "apply_rule")
    assert versions == ["v1", "v2", "v3", "v4"]
    assert {r["mla_segments"] for r in results if r["tool"] == "check_model"} == {2}
    assert history["page"]["total"] == 5


@pytest.mark.skipif(not HAS_EDIT, reason="surgery.edit / surgery.split are not in this install")
async def test_edit_split_merge(sandbox: Sandbox) -> None:
    async with Client(sandbox.server()) as client:
        await call(client, "open_model", {"path": "cnn.onnx"})
        edited = await call(
            client,
            "edit_graph",
            {"model": "cnn", "ops": [{"op": "remove_node", "node": "extra_cast"}]},
        )
        assert edited["version"] == "v1" and edited["action"] == "edit"
        assert edited["nodes_removed"] == ["extra_cast"] and edited["verify"]["passed"]
        assert edited["coverage"]["mla_segments"] == 1 and edited["mla_segments_before"] == 2

        bad = await call_error(
            client, "edit_graph", {"model": "cnn", "ops": [{"op": "remove_node", "node": "zz"}]}
        )
        assert "no node named 'zz'" in bad
        outside = await call_error(
            client,
            "edit_graph",
            {
                "model": "cnn",
                "ops": [{"op": "replace_initializer", "name": "w_1", "npy": "/etc/w.npy"}],
            },
        )
        assert "outside the allowed roots" in outside

        pooled = (await call(client, "find_nodes", {"model": "cnn", "op_type": "MaxPool"}))[
            "nodes"
        ][0]["outputs"][0]["name"]
        head = await call(client, "split_model", {"model": "cnn", "outputs": [pooled]})
        assert head["version"] == "v2" and head["verify"]["passed"]
        assert head["verify"]["mode"] == "exact" and head["nodes_removed_count"] > 0
        tail = await call(
            client,
            "split_model",
            {"model": "cnn", "version": "v1", "inputs": [pooled], "into": "tail"},
        )
        assert tail["model"] == "tail" and tail["verify"] is None and tail["changed"]
        merged = await call(
            client,
            "merge_models",
            {"model_a": "cnn", "model_b": "tail", "io_map": {pooled: pooled}},
        )
        assert merged["version"] == "v3" and merged["coverage"]["single_elf"]
        same = await call(
            client,
            "verify_models",
            {"model": "cnn", "version": "v3", "reference_version": "v1", "exact": True},
        )
        assert same["passed"]
