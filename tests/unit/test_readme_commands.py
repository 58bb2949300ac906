"""The README's commands run as shown on a fresh clone, and the manual's parse.

Every command in the ``bash`` blocks of the README and of the manual's pages (docs/*.md; a ``\\``
continues a line, ``#`` starts a comment) is sorted by one rule:

- **run here** (``sys.executable -m rakv ...``, exit status 0): a README ``rakv`` command that loads
  no model and needs no network: ``--version``, ``--help``, and ``replay`` / ``advise`` whose input
  file ships in the repository. They finish in seconds.
- **parsed only**: every other ``rakv`` command loads a model (the demo's first use fetches a
  93 MB wheel and calibrates; a preset fetches a GB; vLLM's need vLLM's venv) or reads a file an
  earlier command writes. It must still parse with rakv's own parser (its flags and values exist),
  which checks it before any model loads.
- **not rakv**: shell (``source``, ``cat``, ``curl``, ``export``, ``python -c``), ``bash scripts/``
  (setup and the suite itself) and ``rakv-explorer`` (a display) are not run.

The commands run in a scratch folder that links the repository's ``resources/`` and ``docs/``, so
the same relative paths work and what a command writes does not land in the checkout.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NO_MODEL = ("replay", "advise")          # subcommands that read a file and load no model
INPUTS = {"replay": None, "advise": "--profile"}    # where each takes its input: a positional, or a flag


def bash_commands(text: str) -> list[str]:
    """The commands of the ``bash`` blocks, one string each, continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def rakv_argv(command: str) -> list[str] | None:
    """The arguments after ``rakv`` (the last stage of a pipe, without a trailing ``&``); None for
    anything that is not a rakv command."""
    words = shlex.split(command)
    if "|" in words:
        words = words[len(words) - words[::-1].index("|"):]
    if words and words[-1] == "&":
        words = words[:-1]
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]                   # VAR=value before the command
    if words[:3] in (["python", "-m", "rakv"], [".venv/bin/python", "-m", "rakv"]):
        return words[3:]
    return words[1:] if words and words[0] in ("rakv", ".venv/bin/rakv") else None


def why_not_run(argv: list[str]) -> str | None:
    """None where the command runs here; else why it is only parsed."""
    if "--help" in argv or "-h" in argv or argv == ["--version"]:
        return None
    sub = argv[0]
    if sub not in NO_MODEL:
        return "loads a model"
    flag = INPUTS[sub]
    path = argv[1] if flag is None else argv[argv.index(flag) + 1]
    if not (ROOT / path).is_file():
        return f"reads {path}, which an earlier command writes"
    return None


COMMANDS = [c for c in bash_commands(README.read_text()) if rakv_argv(c) is not None]
DOCS = sorted({c for page in sorted((ROOT / "docs").glob("*.md")) for c in bash_commands(page.read_text())
               if rakv_argv(c) is not None} - set(COMMANDS))
OTHER = [c for c in COMMANDS if why_not_run(rakv_argv(c)) is not None] + DOCS
RUN = [c for c in COMMANDS if why_not_run(rakv_argv(c)) is None]


@pytest.mark.fast
def test_the_readme_shows_commands_that_run_without_a_model():
    assert len(COMMANDS) >= 8 and len(RUN) >= 3, (COMMANDS, RUN)


@pytest.mark.parametrize("command", RUN)
def test_cheap_command_runs_as_shown(command, tmp_path):
    for name in ("resources", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "rakv", *rakv_argv(command)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


@pytest.mark.fast
@pytest.mark.parametrize("command", OTHER)
def test_every_other_command_parses(command, tmp_path, monkeypatch, capsys):
    argv = rakv_argv(command)
    if argv[0] == "bench":                  # rakv bench parses its own flags (rakv.cli hands them over)
        from rakv.bench import build_parser

        argv = argv[1:]
    else:
        from rakv.cli import build_parser
    monkeypatch.chdir(tmp_path)
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{command}: does not parse (exit {e.code}): {capsys.readouterr().err.strip()}")
