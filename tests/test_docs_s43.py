"""The docs name only what exists: every `dflash` / `dflashd` / `dflash-client` subcommand and
--flag written in README.md and docs/*.md is one of that command's options, every DFLASH_*
variable is read somewhere (or is a DFLASH_<setting> of the daemon's config), and every module,
script or test a current-state doc names as a file is in the tree.

Session 43's audit found the docs right on flags and wrong in prose (stale defaults, missing
fields); these pin the cheap part, so a renamed option or a removed module shows up here instead
of in a user's shell. The benchmark write-ups (docs/benchmark.md, docs/measured-history.md) are
history: the files they name may be gone (they say so), so the file check skips them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = {"benchmark.md", "measured-history.md"}
SHORT = {"train-draft", "eval-draft", "draft-vocab", "make-tiny"}  # written without `dflash` in prose


def _groups() -> dict[str, click.Command]:
    from dflash.client.cli import main as client
    from dflash.daemon.cli import main as daemon
    from dflash.engine.cli import main as engine

    return {"dflash": engine, "dflashd": daemon, "dflash-client": client}


def _options(cmd: click.Command) -> set[str]:
    names = {"-h", "--help"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def _option(cmd: click.Command, word: str) -> click.Option | None:
    name = word.split("=")[0]
    return next((p for p in cmd.params if isinstance(p, click.Option)
                 and name in (*p.opts, *p.secondary_opts)), None)


def _spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every code-block line and every `inline span` (also one broken over lines)."""
    text = path.read_text()
    spans: list[tuple[int, str]] = []
    in_code = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        elif in_code and not line.lstrip().startswith("#"):
            spans.append((i, line.split(" #")[0]))
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"`([^`]+)`", prose):
        spans.append((prose[: m.start()].count("\n") + 1, m.group(1).replace("\n", " ")))
    return spans


def _commands_named(path: Path, groups: dict[str, click.Command]):
    """(line, command path, the --flags written after it) for each command line in the doc."""
    for line, span in _spans(path):
        for part in re.split(r";|\||&&", span):
            toks = part.split()
            toks = [w for t in toks for w in (["dflash", t] if t in SHORT else [t])]
            for j, tok in enumerate(toks):
                if tok not in groups or (tok == "dflash" and j + 1 < len(toks) and toks[j + 1] == "dflash"):
                    continue
                cmd, names, k = groups[tok], [tok], j + 1
                parents = [cmd]
                while isinstance(cmd, click.Group) and k < len(toks):
                    opt = _option(cmd, toks[k])
                    if opt is not None:  # a group's own option before the subcommand
                        k += 1 if opt.is_flag else 2
                        continue
                    if toks[k] not in cmd.commands:
                        break
                    cmd = cmd.commands[toks[k]]
                    names.append(toks[k])
                    parents.append(cmd)
                    k += 1
                if isinstance(cmd, click.Group) and k < len(toks) and re.fullmatch(r"[a-z][a-z-]+", toks[k]) \
                        and tok != "dflash-client":
                    yield line, " ".join(names), [f"<subcommand {toks[k]}>"]
                    continue
                flags = []
                for t in toks[k:]:
                    if t in groups or t.lstrip("(`") in ("python", "python3", "make"):
                        break
                    m = re.match(r"^(--?[A-Za-z][\w-]*)(?![\w*])", t.strip("()[],.:'\""))
                    if m:
                        flags.append((m.group(1), parents))
                yield line, " ".join(names), flags


def test_every_command_and_flag_the_docs_name_exists():
    groups = _groups()
    wrong, seen = [], 0
    for path in DOCS:
        for line, name, flags in _commands_named(path, groups):
            seen += 1
            for flag in flags:
                if isinstance(flag, str):
                    wrong.append(f"{path.name}:{line}: `{name}` has no {flag}")
                    continue
                fl, parents = flag
                # an option of the command itself, or of a group above it (dflash-client --endpoint)
                if not any(fl in _options(p) for p in parents):
                    wrong.append(f"{path.name}:{line}: `{name}` has no option {fl}")
    assert not wrong, "\n".join(wrong)
    assert seen > 150, f"only {seen} command lines found: the parser no longer reads the docs"


def _python_sources() -> str:
    parts = []
    for folder in ("engine", "daemon", "client", "cache", "scripts", "tests", "launchd"):
        for f in (ROOT / folder).rglob("*.py"):
            parts.append(f.read_text(errors="replace"))
    return "\n".join(parts)


def test_every_environment_variable_the_docs_name_is_read():
    from dflash.daemon.config import DaemonConfig

    code = _python_sources()
    settings = {f"DFLASH_{f.name.upper()}" for f in dataclasses.fields(DaemonConfig)}
    wrong = []
    for path in DOCS:
        for var in sorted(set(re.findall(r"\bDFLASH_[A-Z][A-Z0-9_]*", path.read_text()))):
            if var not in settings and var not in code:
                wrong.append(f"{path.name}: {var} is read nowhere")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", [p for p in DOCS if p.name not in HISTORY], ids=lambda p: p.name)
def test_every_file_a_current_doc_names_exists(path):
    wrong = []
    text = path.read_text()
    for m in re.finditer(r"(?<![\w./~-])((?:engine|daemon|client|cache|scripts|tests|launchd)/[\w./-]*\w)", text):
        name = m.group(1)
        if text[m.end(): m.end() + 1] in ("*", "{") or (ROOT / name).exists():  # a glob: not one file
            continue
        module = re.sub(r"\.\w+$", ".py", name)  # engine/prefix.take: a function of engine/prefix.py
        if (ROOT / module).exists():
            continue
        wrong.append(f"{path.name}:{text[: m.start()].count(chr(10)) + 1}: {name}")
    assert not wrong, "\n".join(wrong)
