"""The desktop: the missing-library line before Qt starts, a window that fits the screen and
remembers its geometry, empty plots with sane axes, and the explorer's conversation mode."""

from __future__ import annotations

import subprocess

import pytest

from app import desktop

LDD_OUT = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f)
\tlibxcb-icccm.so.4 => not found
"""


def fake_ldd(out: str):
    def run(cmd, **kw):
        assert cmd[0] == "ldd"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")
    return run


def test_message_names_libraries_and_install_commands():
    msg = desktop.message(["libxcb-icccm.so.4", "libxcb-keysyms.so.1"])
    assert "\n" not in msg
    assert "missing system libraries libxcb-icccm.so.4, libxcb-keysyms.so.1" in msg
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0 (Debian/Ubuntu)" in msg
    assert "sudo dnf install xcb-util-wm xcb-util-keysyms xcb-util-cursor (Fedora)" in msg
    odd = desktop.message(["libfoo.so.9"])
    assert "libfoo.so.9: install the package" in odd and "\n" not in odd


def test_missing_libraries_from_ldd(tmp_path, monkeypatch):
    plugin = tmp_path / "libqxcb.so"
    plugin.write_bytes(b"")
    monkeypatch.setattr(desktop.shutil, "which", lambda name: "/usr/bin/ldd")
    x11 = {"DISPLAY": ":0"}
    got = desktop.missing_libraries(x11, plugin, run=fake_ldd(LDD_OUT))
    assert got == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    assert desktop.missing_libraries({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, plugin, run=fake_ldd(LDD_OUT))
    # Qt will not use xcb: nothing to check
    for env in ({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"}, {"WAYLAND_DISPLAY": "wayland-0"}, {}):
        assert desktop.missing_libraries(env, plugin, run=fake_ldd(LDD_OUT)) == []
    assert desktop.missing_libraries(x11, plugin, run=fake_ldd("\tlibc.so.6 => /lib/libc.so.6\n")) == []
    monkeypatch.setattr(desktop.shutil, "which", lambda name: None)          # no ldd: no check
    assert desktop.missing_libraries(x11, plugin, run=fake_ldd(LDD_OUT)) == []


def test_no_display_line():
    assert "no display" in desktop.no_display({}, "linux")
    assert desktop.no_display({"DISPLAY": ":1"}, "linux") is None
    assert desktop.no_display({"QT_QPA_PLATFORM": "offscreen"}, "linux") is None
    assert desktop.no_display({}, "darwin") is None


def test_explorer_says_one_line_instead_of_qts_abort(monkeypatch, capsys):
    import sys

    import app.main as m

    monkeypatch.setattr(desktop, "check", lambda env=None: desktop.message(["libxcb-icccm.so.4"]))
    monkeypatch.setattr(desktop, "no_display", lambda env=None: None)
    had_qapp = "PySide6.QtWidgets" in sys.modules and sys.modules["PySide6.QtWidgets"].QApplication.instance()
    assert m.main(["--exit-after-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rakv-explorer: error: Qt cannot load its X11 platform plugin")
    assert "apt-get install libxcb-icccm4" in err and "Traceback" not in err
    if not had_qapp and "PySide6.QtWidgets" in sys.modules:   # it stopped before creating the application
        assert sys.modules["PySide6.QtWidgets"].QApplication.instance() is None


@pytest.mark.fast
def test_fit_to_screen():
    assert desktop.fit((0, 0, 1600, 1000)) == (50, 30, 1500, 940)
    x, y, w, h = desktop.fit((0, 0, 1280, 720))
    assert (w, h) == (1264, 680) and x >= 0 and y >= 0 and x + w <= 1280 and y + h <= 720
    x, y, w, h = desktop.fit((1920, 24, 1366, 744))          # a second monitor, a top panel
    assert 1920 <= x and x + w <= 1920 + 1366 and 24 <= y and y + h <= 24 + 744
    assert desktop.on_screen((50, 30, 1500, 940), (0, 0, 1600, 1000))
    assert not desktop.on_screen((0, 0, 1500, 940), (0, 0, 1280, 720))


# ----------------------------------------------------------------------------- the window
@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import Settings
    from app.window import MainWindow

    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    made = []

    def make(name="s.ini"):
        w = MainWindow(Settings(tmp_path / name), tmp_path / f"sessions-{len(made)}")
        qtbot.addWidget(w)
        made.append(w)
        return w
    yield make
    for w in made:
        w.shutdown()


def test_window_fits_the_screen_and_remembers_its_geometry(window):
    w = window()
    scr = w.screen().availableGeometry()
    assert w.width() <= scr.width() and w.height() <= scr.height()
    w.setGeometry(scr.x() + 10, scr.y() + 10, scr.width() - 60, scr.height() - 80)
    w.save_settings()
    w2 = window()
    assert (w2.width(), w2.height()) == (scr.width() - 60, scr.height() - 80)
    # a saved geometry larger than the screen (another monitor then) is fitted again
    w2.setGeometry(0, 0, scr.width() + 900, scr.height() + 700)
    w2.save_settings()
    w3 = window()
    assert w3.width() <= scr.width() and w3.height() <= scr.height()


def test_empty_plots_have_sane_axes_and_say_so(window):
    w = window()
    w.resize(1280, 720)
    snap = w.panel_snapshot()
    for name in ("cache", "costs", "acceptance", "timeline"):
        assert snap[name]["empty"], name
        panel = getattr(w, name)
        (x0, x1), (y0, y1) = panel.plot.getPlotItem().viewRange()
        assert x1 - x0 >= 1 and y1 - y0 >= 1 or name == "acceptance" and y1 - y0 > 1
        assert abs(y0) < 1e-9 and abs(x0) <= 1                      # not -1e-163 ... 3e-163
        assert panel.nodata.item.isVisible() and panel.nodata.item.textItem.toPlainText() == "no data yet"


# ----------------------------------------------------------------------------- conversation mode
def test_conversation_mode(window, qtbot, chat_pair):
    """Turns continue one conversation (the prompt is the whole conversation, the turns before
    reused from the cache), the cache panel says how much came from the conversation before, and
    New conversation starts over."""
    from rakv.drafts.model import ModelDraft
    from rakv.prompts import encode_prompt

    target, draft = chat_pair
    w = window()
    with qtbot.waitSignal(w.modelsLoaded, timeout=120_000):
        w.use_models(target, ModelDraft(draft), None)
    rp = w.run_panel
    rp.policy.setCurrentText("kv")
    rp.max_new.setValue(6)
    rp.conversation.setChecked(True)
    assert rp.run.text() == "Send" and rp.new_conv.isEnabled()
    for text in ("Hi!", "And what did I just say?"):
        rp.prompt.setPlainText(text)
        with qtbot.waitSignal(w.runFinished, timeout=120_000) as sig:
            w.run()
        assert sig.args[0] is not None and sig.args[0].stopped != "error"
        assert rp.prompt_text() == ""                 # the message went into the conversation
    w.redraw()
    st = w.live
    t1, t2 = st.turns
    assert (t1.turn, t2.turn, t2.conversation) == (1, 2, 1) and t2.ids_from == "append"
    assert t2.previous_tokens == t1.prompt_tokens + t1.output_tokens == t2.hit_tokens == t2.from_before
    snap = w.panel_snapshot()
    note = snap["cache"]["conversation"]
    assert note.startswith("conversation 1, turn 2:") and f"{t2.from_before} of the {t2.previous_tokens}" in note
    assert snap["cache"]["ticks"][-2:] == ["1.1", "1.2"]
    assert "Conversation 1, turn 2" in snap["tokens"]["title"]
    assert rp.conv_info.text().startswith("conversation 1: 2 turns")
    # the tokens of the turn before are all reused (blue) in the token stream
    assert all(t.kind == "reused" for t in st.tokens[:t2.hit_tokens - 1])
    # a new conversation: the next turn is turn 1 of conversation 2
    w.new_conversation()
    assert rp.conv_info.text() == "the next message starts a new conversation"
    rp.prompt.setPlainText("Name three prime numbers.")
    with qtbot.waitSignal(w.runFinished, timeout=120_000):
        w.run()
    w.redraw()
    t3 = w.live.turns[-1]
    assert (t3.conversation, t3.turn, t3.previous_tokens) == (2, 1, 0)
    assert w.live.prompt_tokens == len(encode_prompt(target.tokenizer, "Name three prime numbers.").ids)
    # an empty message is refused with a dialog, nothing runs
    n = len(w.live.turns)
    w.run()
    assert not w.running and w.errors[-1].startswith("type the next message") and len(w.live.turns) == n
    # the mode persists
    w.save_settings()
    assert window().run_panel.conversation.isChecked()


def test_conversation_replays_like_live(window, qtbot, chat_pair, tmp_path):
    from app.state import SessionState
    from rakv.drafts.ngram import NgramDraft
    from rakv.records import read_recording

    target, _ = chat_pair
    w = window()
    with qtbot.waitSignal(w.modelsLoaded, timeout=120_000):
        w.use_models(target, NgramDraft(), None)
    rp = w.run_panel
    rp.policy.setCurrentText("kv")
    rp.max_new.setValue(5)
    rp.conversation.setChecked(True)
    for text in ("Hi!", "More."):
        rp.prompt.setPlainText(text)
        with qtbot.waitSignal(w.runFinished, timeout=120_000):
            w.run()
    replayed = SessionState()
    replayed.apply_all(read_recording(w.worker.recording))
    assert replayed.summary()["turns"] == w.live.summary()["turns"] and len(replayed.turns) == 2
