"""The rule catalogue (docs/rules.md) is generated from the registry and must stay in sync.

Regenerate after adding or changing a rule:  python -m surgery.rules.docs > docs/rules.md
"""

from __future__ import annotations

import subprocess
import sys

from surgery.rules import all_rules
from surgery.rules.docs import render
from tests.conftest import REPO

CATALOGUE = REPO / "docs" / "rules.md"
REGENERATE = "python -m surgery.rules.docs > docs/rules.md"


def test_committed_catalogue_matches_the_registry():
    assert CATALOGUE.exists(), f"docs/rules.md is missing; run `{REGENERATE}`"
    assert CATALOGUE.read_text(encoding="utf-8") == render(), (
        f"docs/rules.md is out of date with the registered rules; run `{REGENERATE}`"
    )


def test_every_rule_has_a_documented_section():
    text = render()
    for cls in all_rules():
        info = cls.describe()
        assert f"### `{info['name']}`" in text
        assert info["summary"] and info["doc"], f"{info['name']} needs a summary and a docstring"
        if info["exactness"] == "approximate":
            assert info["error_bound"] > 0, f"{info['name']} must declare its error bound"
            assert f"max_rel ≤ {info['error_bound']:g}" in text


def test_module_entry_point_writes_utf8_markdown():
    out = subprocess.run(
        [sys.executable, "-m", "surgery.rules.docs"],
        capture_output=True,
        check=True,
        cwd=REPO,
        env={"PYTHONIOENCODING": "ascii", "LC_ALL": "C", "PATH": ""},
    ).stdout.decode("utf-8")
    assert out == render()
