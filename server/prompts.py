"""The `make_single_elf` prompt: the agent loop this server exists for, as instructions."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

from server.state import ServerState

LOOP = """\
Goal: make the ONNX model at `{model_path}` compile to exactly ONE MLA segment (one .elf) on
target `{target}`, without changing what it computes. Use the model-surgery MCP tools only;
never edit files by hand. Every edit becomes a new, verified workspace version; nothing is lost.

1. open_model(path="{model_path}") -> note the returned `model` name. If the summary shows
   dynamic_dims, call open_model again with input_shapes (e.g. {{"images": [1, 3, 640, 640]}}).
2. check_model(model, target="{target}") -> mla_segments, single_elf and blocker_groups (each
   group: reason, op types, nodes, suggested_rules). If single_elf is true and there are no
   blockers, go to step 7.
3. suggest_rules(model, target="{target}") -> the rules whose matches remove blockers.
   Prefer exact rules (data movement) over approximate ones. Either:
   - apply_rule(model, rule, target="{target}") for one rule (optionally nodes=[...]), or
   - fix_model(model, target="{target}") to let the server pick and verify rules in a loop.
   Each returns the new version, nodes added/removed, the verification and the new
   mla_segments. A rule that fails verification is rolled back and reported as an error.
4. For blockers no rule matches: inspect_node(model, node, hops=1) and explain_op(op,
   target="{target}") to understand the constraint. Post-processing at the end of the graph
   (box decode, NMS, TopK, score filtering) usually belongs on the host: cutting it there
   does not add an .elf. Do not force numerically risky rewrites.
5. verify_models(model) compares the latest version with its parent; pass
   reference_version="v0" to compare with the original end to end.
6. check_model again. Repeat 3-6 until single_elf is true or no rule helps. history(model)
   and diff_versions(model, a, b) show what changed; revert(model, version) undoes.
7. export_model(model, path="<name>_single_elf.onnx") writes the result. Report: segments
   before -> after, the rules applied, the verification numbers, and any blockers left with
   their reasons. Quantization and compilation come next (quantize_model, compile_model).
"""


def register(mcp: MCPServer, state: ServerState) -> None:
    @mcp.prompt(title="Make it a single .elf")
    def make_single_elf(model_path: str, target: str = state.default_target) -> str:
        """Walk an agent through check -> rules -> verify -> re-check until the model maps to
        one MLA segment on the target."""
        return LOOP.format(model_path=model_path, target=target)
