"""`surgery skills install`: copy the model-surgery agent skill where a client finds it."""

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from surgery.cli.app import app, console, emit_json, handle_errors
from surgery.cli.options import JsonOpt

skills_app = typer.Typer(
    name="skills",
    help="Install the model-surgery agent skill for Claude Code, Codex or other agents.",
    no_args_is_help=True,
)
app.add_typer(skills_app)


@skills_app.command("install")
@handle_errors
def install_command(
    client: Annotated[
        str,
        typer.Option(
            "--client",
            help="claude (~/.claude/skills), codex or agents (.agents/skills).",
        ),
    ] = "claude",
    project: Annotated[
        Path | None,
        typer.Option(
            "--project",
            help="Install into DIR/.claude/skills (or DIR/.agents/skills) instead of your home.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing, different copy.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Copy the skill (SKILL.md + references) and print how to register the MCP server.

    Destinations: ~/.claude/skills/model-surgery, or .agents/skills/model-surgery for codex and
    agents; with --project DIR, under DIR instead of your home folder.
    """
    from server.skill import install_skill, registration_text

    result = install_skill(client, project, force=force)  # type: ignore[arg-type]
    text = registration_text(client, project)  # type: ignore[arg-type]
    if as_json:
        emit_json(
            {
                "status": result.status,
                "source": str(result.source),
                "destination": str(result.destination),
                "register": text,
            }
        )
        return
    console.print(
        f"{escape(result.status)} {escape(str(result.destination))}",
        highlight=False,
        soft_wrap=True,
    )
    console.print("\nRegister the MCP server:\n", highlight=False)
    console.print(text, highlight=False, soft_wrap=True, markup=False)
