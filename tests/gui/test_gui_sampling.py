"""The explorer's sampling controls (offscreen, pytest-qt): temperature, filters, seed and the
verification mode act on the next request, bad values say why instead of applying, the settings
remember them, and the acceptance panel says how the request chose its tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from app.main import main as explorer_main  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.window import MainWindow  # noqa: E402
from rakv.config import Sampling  # noqa: E402
from tests.gui.test_gui import win  # noqa: E402,F401 - the explorer's window on tiny models

T = 30_000


def run(qtbot, w, policy: str):
    w.run_panel.policy.setCurrentText(policy)
    with qtbot.waitSignal(w.runFinished, timeout=T) as blocker:
        w.run()
    w.redraw()
    return blocker.args[0]


def test_the_controls_set_the_next_requests_sampling(qtbot, win):
    c = win.controls
    with qtbot.waitSignal(c.samplingChanged, timeout=T) as sig:
        c.temperature.setValue(14)                        # 14 x 0.05
    assert sig.args[0].temperature == pytest.approx(0.7) and sig.args[0].verify == "seeded"
    c.seed.setText("41")
    c.seed.editingFinished.emit()
    assert win.worker.controls.sampling == Sampling(temperature=0.7, seed=41)
    first = run(qtbot, win, "ar")
    second = run(qtbot, win, "spec:4")          # request 1: seed 42, not 41
    assert win.live.sampling["seed"] == 42 and win.live.sampling["temperature"] == pytest.approx(0.7)
    assert "seeded verify" in win.acceptance.info.text() and "T 0.70" in win.acceptance.info.text()
    assert first.request_id == 0 and second.request_id == 1


def test_seeded_speculation_in_the_explorer_gives_the_target_only_tokens(qtbot, win):
    c = win.controls
    c.set_sampling(Sampling(temperature=0.9, seed=5))
    win.worker.set_controls(sampling=c.sampling())
    a = run(qtbot, win, "ar").output_ids
    c.set_sampling(Sampling(temperature=0.9, seed=4))       # request 1 samples with seed 4 + 1 = 5
    win.worker.set_controls(sampling=c.sampling())
    b = run(qtbot, win, "joint:4").output_ids
    assert a == b


def test_a_bad_seed_says_why_and_applies_nothing(qtbot, win):
    c = win.controls
    c.temperature.setValue(10)
    before = win.worker.controls.sampling
    c.seed.setText("minus one")
    c.seed.editingFinished.emit()
    assert "seed must be an integer" in c.sampling_error.text()
    assert win.worker.controls.sampling == before
    c.seed.setText("-1")
    c.seed.editingFinished.emit()
    assert "seed" in c.sampling_error.text() and win.worker.controls.sampling == before


def test_greedy_greys_out_the_filters(win):
    c = win.controls
    c.temperature.setValue(0)
    assert c.t_label.text() == "greedy" and not c.top_k.isEnabled() and not c.verify.isEnabled()
    c.temperature.setValue(4)
    assert c.top_k.isEnabled() and c.t_label.text() == "T = 0.20"


def test_the_settings_remember_the_sampling(qtbot, tmp_path, errors):
    path = tmp_path / "s.ini"
    w = MainWindow(Settings(path), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.controls.set_sampling(Sampling(temperature=0.6, top_p=0.9, seed=9, verify="rejection"))
    w.save_settings()             # (closing the window saves them too)
    w.shutdown()
    w2 = MainWindow(Settings(path), tmp_path / "sessions2")
    qtbot.addWidget(w2)
    assert w2.controls.sampling() == Sampling(temperature=0.6, top_p=0.9, seed=9, verify="rejection")
    assert w2.worker.controls.sampling == w2.controls.sampling()
    w2.shutdown()


def test_the_explorer_refuses_bad_sampling_flags(capsys):
    assert explorer_main(["--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert explorer_main(["--top-p", "2"]) == 2
