"""The agent skill: format limits, generated references in sync, and `surgery skills install`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from server.catalogue import reference_files
from server.cli import app
from server.skill import (
    SkillError,
    install_skill,
    registration_text,
    skill_destination,
    skill_source,
)
from surgery.rules import all_rules
from surgery.targets import available_targets

SKILL = Path(__file__).resolve().parents[1] / "skills" / "model-surgery"


def _frontmatter(text: str) -> tuple[dict, str]:
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert match, "SKILL.md must start with YAML frontmatter between --- lines"
    return yaml.safe_load(match.group(1)), match.group(2)


def test_skill_md_follows_the_agent_skills_format() -> None:
    meta, body = _frontmatter((SKILL / "SKILL.md").read_text(encoding="utf-8"))
    assert meta["name"] == "model-surgery" == SKILL.name
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", meta["name"]) and len(meta["name"]) <= 64
    description = meta["description"]
    assert 100 < len(description) <= 1024
    assert "Use when" in description  # says when, not only what
    assert len(body.splitlines()) < 500
    for needle in ("check_model", "suggest_rules", "fix_model", "verify_models", "surgery check"):
        assert needle in body


def test_skill_mentions_only_real_tools_and_references() -> None:
    body = (SKILL / "SKILL.md").read_text(encoding="utf-8")
    for ref in re.findall(r"`(references/[^`]+)`", body):
        pattern = ref.replace("<target>", "*")
        assert list(SKILL.glob(pattern)), f"SKILL.md points at missing {ref}"
    rule_names = {r.name for r in all_rules()}
    mentioned = set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", body)) - {"model-surgery"}
    assert mentioned, "the skill should name the key rules"
    assert mentioned <= rule_names, f"SKILL.md names unknown rules: {mentioned - rule_names}"


def test_references_are_in_sync_with_the_registry() -> None:
    """Fails when a rule or a target profile changed without regenerating the references."""
    expected = reference_files()
    stale = [
        rel
        for rel, text in expected.items()
        if not (SKILL / "references" / rel).is_file()
        or (SKILL / "references" / rel).read_text(encoding="utf-8") != text
    ]
    assert not stale, (
        f"skills/model-surgery/references is out of date ({', '.join(stale)}); "
        "run `python -m server.catalogue` and commit the result"
    )
    assert {f"targets/{t}.md" for t in available_targets()} <= set(expected)
    for cls in all_rules():
        assert f"`{cls.name}`" in expected["rules.md"]


def test_install_for_each_client(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = install_skill("claude", home=home)
    assert first.status == "installed"
    assert first.destination == home / ".claude" / "skills" / "model-surgery"
    assert (first.destination / "SKILL.md").read_bytes() == (SKILL / "SKILL.md").read_bytes()
    assert (first.destination / "references" / "rules.md").is_file()
    assert install_skill("claude", home=home).status == "unchanged"

    (first.destination / "SKILL.md").write_text("local edit")
    with pytest.raises(SkillError, match="--force"):
        install_skill("claude", home=home)
    assert install_skill("claude", home=home, force=True).status == "updated"

    project = tmp_path / "proj"
    project.mkdir()
    for client, folder in (("codex", ".agents"), ("agents", ".agents"), ("claude", ".claude")):
        dest = skill_destination(client, project)
        assert dest == project / folder / "skills" / "model-surgery"
    codex = install_skill("codex", project)
    assert (project / ".agents" / "skills" / "model-surgery" / "SKILL.md").is_file()
    assert codex.status == "installed"
    with pytest.raises(SkillError, match="unknown client"):
        skill_destination("vim", project)  # type: ignore[arg-type]


def test_registration_text_has_every_client() -> None:
    text = registration_text("codex")
    assert text.startswith("Codex")
    assert "claude mcp add model-surgery -- " in text and text.rstrip().endswith("}}}")
    assert "[mcp_servers.model-surgery]" in text
    block = text[text.index("{") :]
    config = json.loads(block)
    assert config["mcpServers"]["model-surgery"]["args"] == ["serve"]
    assert "--scope project" in registration_text("claude", Path("."))


def test_cli_install(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(
        app, ["skills", "install", "--project", str(tmp_path), "--client", "claude", "--json"]
    )
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert data["status"] == "installed"
    assert Path(data["destination"]) == tmp_path / ".claude" / "skills" / "model-surgery"
    assert "claude mcp add --scope project model-surgery" in data["register"]
    missing = runner.invoke(app, ["skills", "install", "--project", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    assert "not an existing folder" in missing.output


def test_skill_source_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert skill_source() == SKILL
    monkeypatch.setenv("SURGERY_SKILL_DIR", str(tmp_path))
    assert skill_source() == SKILL  # no SKILL.md there: fall back to the checkout
    (tmp_path / "SKILL.md").write_text("---\nname: model-surgery\n---\n")
    assert skill_source() == tmp_path
