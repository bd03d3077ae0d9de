"""Installing the `model-surgery` agent skill and telling the user how to register the server.

The skill lives in the repository at `skills/model-surgery/`. An editable install finds it
beside the package; a wheel needs it installed as data (see `SHARE_DIR`). `SURGERY_SKILL_DIR`
overrides both (tests, custom layouts).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from surgery.errors import SurgeryError

SKILL_NAME = "model-surgery"
SHARE_DIR = Path("share") / "model-surgery" / "skills" / SKILL_NAME
Client = Literal["claude", "codex", "agents"]
CLIENTS: tuple[Client, ...] = ("claude", "codex", "agents")


class SkillError(SurgeryError):
    code = "skill_error"


def skill_source() -> Path:
    """The folder holding SKILL.md and references/ (repository checkout or installed data)."""
    candidates = []
    if env := os.environ.get("SURGERY_SKILL_DIR"):
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[1] / "skills" / SKILL_NAME)
    candidates.append(Path(sys.prefix) / SHARE_DIR)
    for folder in candidates:
        if (folder / "SKILL.md").is_file():
            return folder
    raise SkillError(
        "the model-surgery skill files are not installed with this package "
        f"(looked in {', '.join(str(c) for c in candidates)})",
        hint="install from a source checkout (pip install -e .) or set SURGERY_SKILL_DIR to "
        "a copy of skills/model-surgery",
    )


def skill_destination(
    client: Client, project: Path | None = None, home: Path | None = None
) -> Path:
    """Where a client looks for skills: ~/.claude/skills or .agents/skills (codex, agents)."""
    if client not in CLIENTS:
        raise SkillError(f"unknown client {client!r}", hint=f"use one of: {', '.join(CLIENTS)}")
    base = project if project is not None else (home or Path.home())
    folder = ".claude" if client == "claude" else ".agents"
    return base / folder / "skills" / SKILL_NAME


@dataclass(frozen=True)
class InstallResult:
    source: Path
    destination: Path
    status: Literal["installed", "updated", "unchanged"]


def _same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    if mismatch or errors:
        return False
    return all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def install_skill(
    client: Client = "claude",
    project: Path | None = None,
    *,
    force: bool = False,
    home: Path | None = None,
) -> InstallResult:
    """Copy the skill folder into the client's skills folder (atomically replace with force)."""
    source = skill_source()
    if project is not None and not project.is_dir():
        raise SkillError(f"--project {project} is not an existing folder")
    dest = skill_destination(client, project, home)
    existed = dest.exists() or dest.is_symlink()
    if existed and dest.is_dir() and not dest.is_symlink() and _same_tree(source, dest):
        return InstallResult(source, dest, "unchanged")
    if existed and not force:
        raise SkillError(
            f"{dest} already exists and differs from this version of the skill",
            hint="pass --force to replace it (local edits there are lost)",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SKILL_NAME}.", dir=dest.parent))
    try:
        shutil.copytree(source, staging / SKILL_NAME, ignore=shutil.ignore_patterns("__pycache__"))
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        elif dest.exists():
            shutil.rmtree(dest)
        os.replace(staging / SKILL_NAME, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return InstallResult(source, dest, "updated" if existed else "installed")


def serve_command() -> list[str]:
    """The command a client should launch: the absolute `surgery` script when we can find it,
    so the client need not share this shell's PATH or virtualenv."""
    exe = shutil.which("surgery")
    return [exe or "surgery", "serve"]


def registration_text(client: Client, project: Path | None = None) -> str:
    """How to register the MCP server with each client; the chosen client first."""
    cmd = serve_command()
    quoted = " ".join(cmd)
    args = ", ".join(f'"{a}"' for a in cmd[1:])
    scope = " --scope project" if project is not None else ""
    blocks = {
        "claude": f"Claude Code:\n  claude mcp add{scope} model-surgery -- {quoted}",
        "codex": (
            "Codex (~/.codex/config.toml):\n"
            "  [mcp_servers.model-surgery]\n"
            f'  command = "{cmd[0]}"\n'
            f"  args = [{args}]"
        ),
        "agents": (
            "Any MCP client (JSON config):\n"
            '  {"mcpServers": {"model-surgery": '
            f'{{"command": "{cmd[0]}", "args": [{args}]}}}}}}'
        ),
    }
    order = [client, *(c for c in CLIENTS if c != client)]
    return "\n\n".join(blocks[c] for c in order)
