"""The first screen (issue 58): every control of the left docks readable in the 837 x 760 window the
explorer opens with offscreen and for --screenshot, as at 1366 x 768; a target named on the command
line never combined with another pair's restored draft."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QPoint, Qt  # noqa: E402
from PySide6.QtWidgets import QAbstractButton, QComboBox, QLabel, QMessageBox, QWidget  # noqa: E402

from app.settings import GENERIC_DRAFTS, Settings, command_line_pair, default_draft  # noqa: E402
from app.window import MainWindow  # noqa: E402


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    made = []

    def make(settings: Settings | None = None):
        w = MainWindow(settings or Settings(tmp_path / "s.ini"), tmp_path / f"sessions-{len(made)}")
        qtbot.addWidget(w)
        made.append(w)
        return w
    yield make
    for w in made:
        w.shutdown()


def cut_controls(w) -> list[str]:
    """The left docks' labels, buttons, check boxes and combo boxes that are narrower than their
    text needs or reach past the dock's visible width (empty when all read in full)."""
    cut = []
    for name in ("run", "controls"):
        area = w.docks[name].widget()            # app.layout.FormScroll
        view = area.viewport()
        assert area.horizontalScrollBar().maximum() == 0, name     # nothing hidden to the right
        for c in area.widget().findChildren(QWidget):
            if not isinstance(c, (QLabel, QAbstractButton, QComboBox)) or not c.isVisible():
                continue
            text = c.currentText() if isinstance(c, QComboBox) else c.text()
            wraps = isinstance(c, QLabel) and c.wordWrap()
            need = (c.minimumSizeHint() if wraps else c.sizeHint()).width()
            left, right = c.mapTo(view, QPoint(0, 0)).x(), c.mapTo(view, QPoint(c.width(), 0)).x()
            if c.width() < need or left < 0 or right > view.width():
                cut.append(f"{name}: {type(c).__name__} {text!r} {c.width()} px of {need}, x {left}..{right} "
                           f"of {view.width()}")
    return cut


@pytest.mark.parametrize("conversation", [False, True])
@pytest.mark.parametrize("size", [(837, 760), (1366, 768)])
def test_left_docks_read_in_full(qtbot, window, size, conversation):
    w = window()
    w.resize(*size)
    w.default_docks()
    w.show()
    qtbot.waitExposed(w)
    w.run_panel.conversation.setChecked(conversation)            # Send, New conversation, its line
    w.run_panel.set_conversation_info("conversation 1: 2 turns, 212 tokens")
    w.controls.k_error.setText("K must hold integers 0 to 64")
    # the status bar after a run, with the notice of a replaced draft: it does not widen the window
    w.pair_note = ("draft int8 for demo (not qwen-coder-0.5b)", "the whole line")
    w.show_settings_note()
    w.msg.setText("request 0: 48 tokens in 1236 ms (max_new_tokens) · recording to session-20261207-005436.jsonl")
    w.stats.setText("38.8 tok/s · TTFT 160 ms · exploration 0 ms (0.00% of session)")
    w.lag_label.setText("lag max 40 ms · p99 29 ms")
    qtbot.wait(50)
    assert (w.width(), w.height()) == size                 # the window did not grow past the screen's size
    assert cut_controls(w) == []
    for name in ("run", "controls"):
        assert w.docks[name].width() >= w.docks[name].widget().form_width()
    # the centre gives way: at 837 px the side docks keep their forms' width, the tabs get the rest
    assert w.central.width() >= 250
    # a dock dragged (or a saved layout) narrower than its form: Qt keeps the form's width
    w.resizeDocks([w.docks["run"]], [70], Qt.Orientation.Horizontal)
    qtbot.wait(50)
    assert cut_controls(w) == []


def test_the_window_opens_with_the_left_docks_readable(qtbot, window):
    """The size the window opens with (offscreen: fitted to an 800 x 800 screen, then as wide as the
    docks' minimums), the default dock layout."""
    w = window()
    w.show()
    qtbot.waitExposed(w)
    qtbot.wait(50)
    assert w.width() <= 900 and cut_controls(w) == []


# ----------------------------------------------------------------------------- --target over a restored pair
def test_command_line_pair_rules():
    assert default_draft("demo") == Settings.DEFAULTS["models/draft"] == "ngram"    # pays on the demo's copies
    assert default_draft("qwen-coder-1.5b") == "qwen-coder-0.5b"
    assert default_draft("qwen-coder-0.5b") == "int8"
    # another pair's model draft gives way to the target's default draft, with a notice
    t, d, note = command_line_pair("demo", None, "qwen-coder-1.5b", "qwen-coder-0.5b")
    assert (t, d) == ("demo", default_draft("demo"))
    assert "qwen-coder-0.5b" in note and "qwen-coder-1.5b" in note and "--target demo" in note
    t, d, note = command_line_pair("/models/mine", None, "demo", "/models/other-draft")
    assert (t, d) == ("/models/mine", default_draft("/models/mine")) and note
    # drafts that fit: made for any target, the same target as before, the target's own draft
    for g in GENERIC_DRAFTS:
        assert command_line_pair("qwen-coder-1.5b", None, "demo", g) == ("qwen-coder-1.5b", g, "")
    assert command_line_pair("demo", None, "demo", "/models/d") == ("demo", "/models/d", "")
    assert command_line_pair("qwen-coder-1.5b", None, "demo", "qwen-coder-0.5b") == (
        "qwen-coder-1.5b", "qwen-coder-0.5b", "")
    # a named draft is used as named; --draft alone keeps the target
    assert command_line_pair("demo", "ngram", "qwen-coder-1.5b", "qwen-coder-0.5b") == ("demo", "ngram", "")
    assert command_line_pair(None, "none", "qwen-coder-1.5b", "qwen-coder-0.5b") == ("qwen-coder-1.5b", "none", "")


def qwen_settings(path) -> Settings:
    s = Settings(path)
    s.set("models/target", "qwen-coder-1.5b")
    s.set("models/draft", "qwen-coder-0.5b")
    s.sync()
    return s


def test_target_replaces_another_pairs_draft_with_a_notice(qtbot, window, tmp_path, capsys):
    w = window(qwen_settings(tmp_path / "s.ini"))
    assert w.run_panel.pair() == ("qwen-coder-1.5b", "qwen-coder-0.5b")    # restored
    w.set_command_line_pair("demo", None)
    w.show()
    qtbot.waitExposed(w)
    assert w.run_panel.pair() == ("demo", default_draft("demo"))
    note = w.settings_note
    assert note.isVisible() and f"draft {default_draft('demo')} for demo (not qwen-coder-0.5b)" in note.text()
    assert "the last session's draft qwen-coder-0.5b went with qwen-coder-1.5b" in note.toolTip()
    assert w.restored_settings() == []                     # neither restored value is held any more
    err = capsys.readouterr().err
    assert err.count("the last session's draft qwen-coder-0.5b") == 1


def test_rakv_explorer_target_demo_after_another_pair(qtbot, tmp_path, monkeypatch, capsys):
    """`rakv-explorer --target demo` after a session with the Qwen pair: the demo's default draft,
    one notice, and the pair kept for the next session."""
    import sys

    import torch

    from app import main as app_main

    ini = tmp_path / "s.ini"
    qwen_settings(ini)
    monkeypatch.setenv("RAKV_SETTINGS", str(ini))
    monkeypatch.setenv("RAKV_SESSIONS", str(tmp_path / "sessions"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    threads = torch.get_num_threads()
    try:
        rc = app_main.main(["--target", "demo", "--screenshot", str(tmp_path / "shot.png"), "--exit-after-run"])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert rc == 0 and "cannot load" not in err
    assert err.count(f"draft {default_draft('demo')} for --target demo") == 1
    s = Settings(ini)
    assert (s.get("models/target"), s.get("models/draft")) == ("demo", default_draft("demo"))


def test_prefix_cache_scrolls_rather_than_overlap(qtbot, window):
    """At 837 x 760 after a replay the prefix cache's lines wrap in a narrow dock: they scroll, one
    under the other, never drawn over each other or over the plot."""
    from pathlib import Path

    w = window()
    w.resize(837, 760)
    w.default_docks()
    w.show()
    qtbot.waitExposed(w)
    assert w.open_recording(str(Path(__file__).resolve().parents[2] / "resources" / "example.jsonl"), play=False)
    w.replay_bar.speed.setCurrentText("max")
    with qtbot.waitSignal(w.replayFinished, timeout=60_000):
        w.replayer.play()
    w.resizeDocks([w.docks["cache"]], [240], Qt.Orientation.Vertical)      # a short dock too
    w.redraw()
    qtbot.wait(50)
    panel = w.cache
    lay = panel.layout()
    rects = [lay.itemAt(i).geometry() for i in range(lay.count())
             if lay.itemAt(i).widget() is None or lay.itemAt(i).widget().isVisible()]
    for a, b in zip(rects, rects[1:]):
        assert a.bottom() < b.top(), (a, b)
    for lab in (panel.hit, panel.detail, panel.draft_line, panel.template_line):
        if lab.isVisible():
            assert lab.height() >= lab.heightForWidth(lab.width()), lab.text()
    assert panel.plot.height() >= panel.plot.minimumHeight()
