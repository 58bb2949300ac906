"""Tiny random models built from a config in seconds; nothing touches the network."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from tests.tiny import make_pair, make_model, tiny_tokenizer  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _rakv_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path_factory.getbasetemp() / "rakv-cache"))
    # calibrations in tests are deterministic: no pauses, re-measuring or contended flag (a busy CI
    # machine would otherwise flip them); tests/test_hardening.py turns the check on where it tests it
    monkeypatch.setenv("RAKV_CONTENTION_CHECK", "0")


@pytest.fixture(autouse=True)
def _collect_outside_qt(request):
    """GUI tests run with automatic garbage collection off and collect after their teardown: a
    collection that starts inside a Qt call (a signal's disconnect asking PySide for a Python
    override allocates) can finalize a Qt object while Qt holds its signal-slot lock, and the
    suite hung there once (tests/test_gui_vllm_watch.py, in a whole-suite run). app/gcguard.py
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
