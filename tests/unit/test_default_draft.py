"""The draft a target gets when none is named (rakv.config.default_draft): the demo's n-gram draft
(its int8 copy costs more than its target under q8 numerics, so it could never pay), int8 for any
other target, and the int8 draft still by name."""

from __future__ import annotations

import pytest

from rakv.cli import build_parser
from rakv.common import resolve_draft
from rakv.config import DEMO_DRAFT, RakvConfig, default_draft


@pytest.mark.fast
def test_the_demo_drafts_by_ngram_and_others_by_int8():
    assert DEMO_DRAFT == "ngram"
    assert default_draft("demo") == default_draft(None) == RakvConfig().draft == "ngram"
    assert default_draft("/models/mine") == RakvConfig(target="/models/mine").draft == "int8"
    assert RakvConfig(draft="int8").draft == "int8"                  # by name it stays


def test_the_cli_default_follows_the_target():
    p = build_parser()
    assert resolve_draft(p.parse_args(["generate", "--prompt", "x"])).draft == "ngram"
    assert resolve_draft(p.parse_args(["generate", "--target", "x.gguf", "--prompt", "x"])).draft == "int8"
    assert resolve_draft(p.parse_args(["generate", "--draft", "int8", "--prompt", "x"])).draft == "int8"
    assert p.parse_args(["calibrate"]).draft is None                 # unresolved, RakvConfig resolves it alike


def test_the_tiny_bench_keeps_its_int8_default():
    from rakv.bench import build_parser as bench_parser

    assert resolve_draft(bench_parser().parse_args(["--tiny"])).draft == "int8"
    assert resolve_draft(bench_parser().parse_args([])).draft == "ngram"


def test_demo_sh_runs_the_default_pair_on_a_copy_friendly_prompt():
    """scripts/demo.sh: both of its commands run the demo with its default (n-gram) draft, and its
    prompt holds the code its answer gives back (what the n-gram draft looks up)."""
    import re
    import subprocess
    from pathlib import Path

    sh = (Path(__file__).resolve().parents[2] / "scripts" / "demo.sh").read_text()
    execs = [ln for ln in sh.splitlines() if ln.strip().startswith("exec ")]
    assert len(execs) == 2 and all(f"--target demo --draft {DEMO_DRAFT}" in ln for ln in execs)
    line = next(ln for ln in sh.splitlines() if ln.startswith("PROMPT="))
    prompt = subprocess.run(["bash", "-c", line + '; printf %s "$PROMPT"'], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"}).stdout
    assert "def is_prime(n):" in prompt and re.search(r"return the whole function", prompt)
