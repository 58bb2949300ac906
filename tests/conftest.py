"""Tiny random models built from a config in seconds; nothing touches the network."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from tests.tiny import make_model, make_pair, save_tiny, tiny_tokenizer, wrap_tiny
from rakv.bench.tiny import perturbed


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _rakv_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path_factory.getbasetemp() / "rakv-cache"))
    # calibrations in tests are deterministic: no pauses, re-measuring or contended flag (a busy CI
    # machine would otherwise flip them); tests/hostile/test_hardening.py turns the check on where it tests it
    monkeypatch.setenv("RAKV_CONTENTION_CHECK", "0")


# Shared models. Each is module-scoped: a test file gets its own copy (a test may change what it is
# given: a cache, a profile), built in well under a second. rakv is imported inside the fixtures, so
# a file that needs none of them does not import it through this one.

@pytest.fixture(scope="module")
def pair():
    """A tiny llama target and its draft (the target perturbed, "mostly" agreeing): (target, draft),
    both loaded models."""
    return make_pair("llama", "mostly")


@pytest.fixture(scope="module")
def drafted(pair):
    """``pair`` with its draft as a ModelDraft: (target, draft source)."""
    from rakv.drafts.model import ModelDraft

    target, draft = pair
    return target, ModelDraft(draft)


@pytest.fixture(scope="module")
def calibrated(pair):
    """``pair`` and its quick calibration: (target, draft, profile)."""
    from rakv.decide.calibration import calibrate
    from rakv.drafts.model import ModelDraft

    target, draft = pair
    return target, draft, calibrate(target, ModelDraft(draft), quick=True)


@pytest.fixture(scope="module")
def chat_pair():
    """A tiny llama with a chat template and its draft: (target, draft), both loaded models."""
    from rakv.load import wrap

    tok = tiny_tokenizer(chat=True)
    t = make_model("llama", seed=0)
    return wrap_tiny(t, tok, name="tiny-chat"), wrap(perturbed(t, 0.01), tok, name="tiny-chat-draft")


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """Tiny models saved as folders the CLI loads: (folder, the target's torch module). The folder
    holds ``target/`` (llama), ``draft/`` (the target perturbed) and ``other-tok/`` (a llama with
    another tokenizer)."""
    d = tmp_path_factory.mktemp("models")
    t = save_tiny(d / "target", "llama")
    save_tiny(d / "draft", draft_of=t)
    save_tiny(d / "other-tok", "llama", seed=3, tokenizer_variant=1)
    return d, t


@pytest.fixture(scope="module")
def models(saved_pair):
    """The folder of ``saved_pair``: ``models / "target"``, ``models / "draft"``."""
    return saved_pair[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama with a chat template saved as a folder the CLI loads; the folder."""
    d = tmp_path_factory.mktemp("chat-model")
    save_tiny(d / "target", "llama", chat=True)
    return d / "target"


@pytest.fixture(autouse=True)
def _collect_outside_qt(request):
    """GUI tests run with automatic garbage collection off and collect after their teardown: a
    collection that starts inside a Qt call (a signal's disconnect asking PySide for a Python
    override allocates) can finalize a Qt object while Qt holds its signal-slot lock, and the
    suite hung there once (tests/gui/test_gui_vllm_watch.py, in a whole-suite run). app/gcguard.py
    does the same for the explorer's windows; this covers what a test does outside a window's
    life (its setup, a shutdown in ``finally``, qtbot's closing of widgets)."""
    if "qtbot" not in request.fixturenames:
        yield
        return
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if was:
            gc.enable()


# PySide6 (6.12, Python 3.11) can abort at interpreter finalization ("deallocating None") after
# every test has passed, when objects that crossed a QThread are garbage-collected during
# shutdown; reproduced with a bare QThread signal script, so not this project's objects. Once
# pytest has printed its summary, leave without finalizing, keeping pytest's exit status.
_EXIT_STATUS = {"code": None}


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _EXIT_STATUS["code"] is not None and os.environ.get("RAKV_TEST_FINALIZE") != "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS["code"])
