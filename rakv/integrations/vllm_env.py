"""What the vLLM commands share below the runner: the arms, the checks of a command line, and
where vLLM runs (this Python or ``RAKV_VLLM_PYTHON``'s). ``rakv bench --peer vllm`` and ``rakv
calibrate --engine vllm`` use these without importing the runner (``vllm_run``), which reads
rakv's workloads."""

from __future__ import annotations

import json
import os
import sys


ARMS = ("plain", "ngram:1", "ngram:2", "ngram:4", "ngram:8", "rakv")
MODES = ("one", "batched", "both")


def check_target(target: str) -> None:
    """A model folder vLLM loads has a config.json: refuse anything else before an engine starts."""
    if not os.path.isdir(target):
        raise ValueError(f"{target}: no such folder (a model folder vLLM loads: config.json, weights, tokenizer)")
    if not os.path.isfile(os.path.join(target, "config.json")):
        raise ValueError(f"{target} has no config.json: not a model folder vLLM loads (docs/vllm.md)")


ARMS_HELP = ("plain, ngram:K (vLLM's n-gram lookup at a fixed K), rakv (the RAKV proposer: copies, and the "
             "model draft RAKV_VLLM_DRAFT names if set), rakvcopy (copies only), draft:K (the model draft at a "
             "fixed K; needs RAKV_VLLM_DRAFT)")


def check_arms(arms, profile_path: str | None = None) -> tuple:
    """The switch's arms (``SwitchProposer``), checked: one line for a name it does not know, a
    repeated one, or ``draft:K`` without a model draft (``RAKV_VLLM_DRAFT``, or the one the
    profile at ``profile_path`` was calibrated with)."""
    arms = tuple(a.strip() for a in arms if a.strip())
    for a in arms:
        if a in ("plain", "rakv", "rakvcopy"):
            continue
        kind, _, k = a.partition(":")
        if kind not in ("ngram", "draft") or not k.isdigit() or int(k) < 1:
            raise ValueError(f"unknown arm {a!r} ({ARMS_HELP})")
        if kind == "draft" and not (os.environ.get("RAKV_VLLM_DRAFT") or _profile_draft(profile_path)):
            raise ValueError(f"arm {a} needs a model draft: a profile calibrated with one (rakv calibrate "
                             "--engine vllm --vllm-draft M) or RAKV_VLLM_DRAFT (docs/vllm.md)")
    if not arms:
        raise ValueError("no arms")
    if len(set(arms)) != len(arms):
        raise ValueError(f"an arm is named twice: {','.join(arms)}")
    return arms


def _profile_draft(path: str | None) -> str | None:
    try:
        with open(path) as f:
            return ((json.load(f) or {}).get("draft") or {}).get("spec")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def vllm_python() -> str | None:
    """Where vLLM runs: None for this Python (it imports vllm), else the python that
    ``RAKV_VLLM_PYTHON`` names, checked to import vllm and rakv (vLLM's CPU build lives in its own
    venv). A missing vLLM raises ValueError with one line, before anything starts."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is not None:
        return None
    exe = os.environ.get("RAKV_VLLM_PYTHON")
    if not exe:
        raise ValueError("vLLM is not importable here: install its CPU build in its own venv (docs/vllm.md) "
                         "and run this with that venv's rakv, or set RAKV_VLLM_PYTHON to its python")
    try:
        ok = subprocess.run([exe, "-c", "import importlib.util as u, sys; "
                                        "sys.exit(0 if u.find_spec('vllm') and u.find_spec('rakv') else 3)"],
                            capture_output=True, timeout=60, env=_with_this_rakv()).returncode
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"RAKV_VLLM_PYTHON={exe} does not run ({type(e).__name__}: {e})") from None
    if ok != 0:
        raise ValueError(f"RAKV_VLLM_PYTHON={exe} cannot import vllm and rakv (install vLLM's CPU build and rakv "
                         "there, or put this rakv on its PYTHONPATH: docs/vllm.md)")
    return exe


def _with_this_rakv() -> dict:
    """The environment for vLLM's python: this rakv first on its PYTHONPATH (vLLM's venv need not
    have rakv installed; the one running this command is the one that runs there)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def run_in_vllm_python(argv: list[str], exe: str | None) -> int:
    """``python -m rakv.integrations.vllm_run ARGV`` in ``exe`` (None: this Python, which has
    vLLM), a process of its own; vLLM's logs go to stderr, its output streams through."""
    import subprocess

    exe = exe or sys.executable
    env = {**_with_this_rakv(), "VLLM_LOGGING_STREAM": os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stderr")}
    with subprocess.Popen([exe, "-m", "rakv.integrations.vllm_run", *argv], env=env, stdout=subprocess.PIPE,
                          text=True, bufsize=1) as p:
        for line in p.stdout:            # through this process's sys.stdout, line by line (a caller may redirect it)
            sys.stdout.write(line)
            sys.stdout.flush()
    return p.returncode


def _int_list(text: str, what: str, lo: int) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, not {text!r}") from None
    if not xs or xs[0] < lo:
        raise ValueError(f"{what} must be integers >= {lo}, not {text!r}")
    return xs
