"""The README's "Tour" as a newcomer types it: every command and flag it shows exists (each
command's --help), and what went wrong when it was walked through from a clean clone stays fixed.
No model is loaded here: these are the command lines' own checks."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dflash.client.cli import main as client_main
from dflash.daemon.cli import main as daemon_main
from dflash.engine.cli import main as engine_main

README = Path(__file__).resolve().parents[1] / "README.md"
PROGRAMS = {"dflash": engine_main, "dflashd": daemon_main, "dflash-client": client_main}
NO_REEXEC = {"DFLASH_BLAS": "none"}  # `dflash generate` & co. would re-exec this process to preload a BLAS


def _tour_commands() -> list[list[str]]:
    """Each command of the README's Tour block, split like a shell (comments dropped, `;` splits)."""
    text = README.read_text()
    block = text.split("## Tour", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        for part in filter(None, (p.strip() for p in line.split(";"))):
            words = shlex.split(part)
            if words and words[0] in PROGRAMS:
                out.append(words)
    return out


def _command(words: list[str]) -> tuple[click.Command, list[str]]:
    """The click command a Tour line runs (through groups), and the words after its name."""
    cmd: click.Command = PROGRAMS[words[0]]
    rest = words[1:]
    while isinstance(cmd, click.Group) and rest and rest[0] in cmd.commands:
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    return cmd, rest


def test_every_tour_command_and_flag_exists() -> None:
    commands = _tour_commands()
    assert len(commands) >= 20, commands  # the block was found and read
    for words in commands:
        cmd, rest = _command(words)
        if isinstance(cmd, click.Group) and cmd.invoke_without_command is False:
            pytest.fail(f"{' '.join(words)}: no such subcommand")
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for w in rest:
            flag = w.strip("[]").split("=", 1)[0]  # [--draft PATH]: an optional flag
            if re.fullmatch(r"-{1,2}[a-z][\w-]*", flag):
                assert flag in known, f"{' '.join(words)}: {flag} is not an option of {cmd.name}"


def test_every_tour_command_has_help() -> None:
    for words in _tour_commands():
        _, rest = _command(words)
        args = words[1:len(words) - len(rest)] + ["--help"]
        res = CliRunner(env=NO_REEXEC).invoke(PROGRAMS[words[0]], args)
        assert res.exit_code == 0 and "Usage:" in res.output, (words, res.output)


def test_dflashd_install_without_a_model_is_a_configuration_error(tmp_path: Path) -> None:
    """`dflashd install` with no model anywhere: exit 2 (docs/daemon.md: a configuration error,
    "no `model`", as `dflashd start` exits), naming the ways to give one; nothing is written."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    env = {"DFLASH_CONFIG": str(cfg), "DFLASH_MODEL": ""}
    res = CliRunner(env=env).invoke(daemon_main, ["install", "--kind", "systemd", "--dest", str(tmp_path / "units"),
                                                  "--no-load", "--state-dir", str(tmp_path / "state")])
    assert res.exit_code == 2, res.output
    assert "no model configured" in res.output and "--model" in res.output
    assert not (tmp_path / "units").exists() and not (tmp_path / "state").exists()
    start = CliRunner(env=env).invoke(daemon_main, ["start", "--state-dir", str(tmp_path / "state"),
                                                    "--runtime-dir", str(tmp_path / "run")])
    assert start.exit_code == res.exit_code == 2


def test_dflash_client_positions_help_lists_every_subcommand_whole() -> None:
    """`dflash-client positions --help`: each subcommand has a line, none cut mid-phrase
    (click ends a short help at the first '.', so "(e.g." was all `put` showed)."""
    res = CliRunner().invoke(client_main, ["positions", "--help"])
    assert res.exit_code == 0, res.output
    lines = res.output.split("Commands:", 1)[1].strip().splitlines()
    helps = {ln.split()[0]: ln.split(None, 1)[1] if len(ln.split()) > 1 else "" for ln in lines}
    assert set(helps) == {"put", "get", "list", "delete"}, res.output
    for name, text in helps.items():
        assert text and "(e.g" not in text, f"{name}: {text!r}"
