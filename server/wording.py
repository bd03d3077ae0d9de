"""The CLI's words in core messages, said as the MCP tools say them.

Reasons, hints and notes come from the core, which phrases them for the command line
("use --input-shape", "see `surgery inspect`"). An agent driving the server has tools, not
commands, so the server rewrites those references once, here, on their way out.
"""

from __future__ import annotations

import re

_CLI_TO_TOOLS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(pattern), replacement)
    for pattern, replacement in [
        (r"`?surgery inspect MODEL --find PATTERN`?", "find_nodes"),
        (r"`?surgery quantize MODEL --calib DATA`?", "quantize_model"),
        (r"`?surgery check --input-shape NAME=DIMS`?", "input_shapes"),
        (r"`?surgery quantize --input-shape NAME=DIMS`?", "quantize_model's input_shapes"),
        (r"--input-shape ([^\s=]+)=([\d,]+)", r"input_shapes={'\1': [\2]}"),
        (r"--input-shape NAME=DIMS", "input_shapes"),
        (r"--input-shape", "input_shapes"),
        (r"\(--name NAME\)", "(name)"),
        (r"`?surgery inspect`?", "find_nodes / inspect_node"),
        (r"`?surgery rules`?", "list_rules"),
        (r"`?surgery check`?", "check_model"),
        (r"`?surgery fix`?", "fix_model"),
        (r"`?surgery quantize`?", "quantize_model"),
        (r"`?surgery compile`?", "compile_model"),
        (r"`?surgery verify`?", "verify_models"),
        (r"`?surgery edit`?", "edit_graph"),
        (r"`?surgery split`?", "split_model"),
        (r"`?surgery merge`?", "merge_models"),
        (r"`?surgery run`?", "run_archive"),
    ]
]


def tool_words(text: str) -> str:
    """`text` with references to `surgery` commands and flags replaced by tool names."""
    if "surgery" not in text and "--" not in text:
        return text
    for pattern, replacement in _CLI_TO_TOOLS:
        text = pattern.sub(replacement, text)
    return text
