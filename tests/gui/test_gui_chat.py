"""The explorer as a user meets it: the chat transcript (copy, export), the cost profile's quality and
Recalibrate, restored settings with a reset, and the paper cuts (replay speed, the measure dialog's
count, a DISPLAY no X server answers). pytest-qt, offscreen, tiny random models."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QApplication, QProgressDialog  # noqa: E402

from app import desktop  # noqa: E402
from app import transcript as T  # noqa: E402
from app.panels.costs import VIEW_REQUESTS, quality_text  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.state import Exchange, SessionState  # noqa: E402
from app.window import MainWindow  # noqa: E402
from rakv.drafts.model import ModelDraft  # noqa: E402
from rakv.records import RequestEnd, RunHeader  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b):"
T_MS = 60_000


def make_window(qtbot, tmp_path, calibrated, settings_name="settings.ini"):
    w = MainWindow(Settings(tmp_path / settings_name), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.show()
    target, draft, profile = calibrated
    with qtbot.waitSignal(w.modelsLoaded, timeout=T_MS):
        w.use_models(target, ModelDraft(draft), profile)
    qtbot.waitUntil(lambda: w.live.header is not None, timeout=T_MS)
    w.run_panel.prompt.setPlainText(PROMPT)
    w.run_panel.max_new.setValue(12)
    w.run_panel.policy.setCurrentText("adaptive")
    return w


@pytest.fixture
def win(qtbot, tmp_path, calibrated, errors):
    w = make_window(qtbot, tmp_path, calibrated)
    yield w
    w.shutdown()


def run(qtbot, w, prompt=None) -> RequestEnd:
    if prompt is not None:
        w.run_panel.prompt.setPlainText(prompt)
    with qtbot.waitSignal(w.runFinished, timeout=T_MS) as blocker:
        w.run()
    w.redraw()
    return blocker.args[0]


# ----------------------------------------------------------------------------- the chat view
def test_chat_shows_the_transcript_copy_and_export(qtbot, win, tmp_path):
    assert win.central.currentWidget() is win.chat and win.central.tabText(1) == "Token stream"
    e1 = run(qtbot, win)
    e2 = run(qtbot, win, prompt="Second question?")
    snap = win.panel_snapshot()["chat"]
    assert snap["messages"] == [("user", PROMPT), ("assistant", e1.text), ("user", "Second question?"),
                                ("assistant", e2.text)]
    assert PROMPT in snap["text"] and "Request 1" in snap["text"]
    # the template shown: the prompt as fed (its ids' pieces) and the answer's ids, specials included
    win.chat.show_template.setChecked(True)
    msgs = win.chat.messages()
    ex = win.live.exchanges[0]
    assert msgs[0].content == "".join(win.tokens.pieces(i) for i in ex.prompt_ids)
    assert msgs[1].content == "".join(win.tokens.pieces(i) for i in e1.output_ids)
    win.chat.show_template.setChecked(False)
    # copy answer: the latest answer, as plain text
    assert win.copy_answer() == e2.text and QApplication.clipboard().text() == e2.text
    # export: Markdown and JSON, written whole (no temporary file left beside them)
    md = win.export_conversation(str(tmp_path / "out" / "chat.md"))
    js = win.export_conversation(str(tmp_path / "out" / "chat.json"))
    text = Path(md).read_text(encoding="utf-8")
    assert text.startswith("# RAKV Explorer transcript") and "**User**" in text and "Second question?" in text
    doc = json.loads(Path(js).read_text(encoding="utf-8"))
    assert doc["format"] == "rakv-transcript" and len(doc["conversations"]) == 2
    assert [m["role"] for m in doc["conversations"][0]["messages"]] == ["user", "assistant"]
    assert doc["conversations"][1]["messages"][1]["content"] == e2.text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["chat.json", "chat.md"]


def test_chat_transcript_replays_the_same(qtbot, win):
    run(qtbot, win)
    live = win.panel_snapshot()["chat"]["messages"]
    assert win.open_recording(str(win.worker.recording), play=False)
    with qtbot.waitSignal(win.replayFinished, timeout=T_MS):
        win.replay_bar.speed.setCurrentText("max")
        win.replayer.play()
    assert win.panel_snapshot()["chat"]["messages"] == live
    win.leave_replay()


def test_running_answer_hides_special_tokens():
    pieces = {1: "<|im_start|>", 2: "system\nYou are helpful.", 3: "<|im_end|>", 4: "Hi", 5: " there",
              6: "<|eot_id|>", 7: "</s>"}.get
    ex = Exchange(0, "Hello", [1, 2, 3, 4], templated=True, output_ids=[4, 5, 6, 7])
    assert T.answer_text(ex, pieces) == "Hi there"                       # running: pieces, specials dropped
    assert T.answer_text(ex, pieces, show_template=True) == "Hi there<|eot_id|></s>"
    assert T.user_text(ex, pieces) == "Hello"
    assert T.user_text(ex, pieces, True).startswith("<|im_start|>system")
    ex.text = "Hi there"
    md = T.to_markdown([ex], pieces, {"models": {"target": "t", "draft": "d"}}, show_template=True)
    assert "```\n<|im_start|>system" in md
    conv = [Exchange(i, f"m{i}", [4], conversation=1, turn=i + 1, text=f"a{i}") for i in range(3)]
    assert [(t, len(e)) for t, e in T.groups(conv + [ex])] == [("Conversation 1", 3), ("Request 0", 1)]


# ----------------------------------------------------------------------------- cost quality
def test_cost_quality_and_prediction_error(qtbot, win):
    h = win.live.header
    assert h.profile["spread"] and h.profile["calibrated_at"]            # the run header carries it
    snap = win.panel_snapshot()["costs"]
    assert ("contended" if h.profile["contended"] else "clean") in snap["quality"] and "spread ≤" in snap["quality"]
    assert "prediction error: —" in snap["quality"]
    ends = [run(qtbot, win), run(qtbot, win, prompt=PROMPT + " return a + b")]
    rows = win.live.prediction_errors()
    assert [r for r, _, _ in rows] == [e.request_id for e in ends]
    assert [m for _, _, m in rows] == [e.latency_ms for e in ends]
    mape = win.live.prediction_mape()
    assert f"prediction error" in win.costs.quality.text() and f"{mape * 100:.0f}%" in win.costs.quality.text()
    # the every-request view: predicted beside measured, one pair per request
    win.costs.which.setCurrentIndex(VIEW_REQUESTS)
    snap = win.panel_snapshot()["costs"]
    assert len(snap["bars"]) == 2 and not snap["empty"]
    assert "measured" in win.costs.tooltip_at(0) and "predicted" in win.costs.tooltip_at(0)
    win.costs.which.setCurrentIndex(0)
    assert len(win.panel_snapshot()["costs"]["bars"]) == 12


def test_quality_line_says_contended():
    st = SessionState()
    st.apply(RunHeader(profile={"contended": True, "reasons": ["this process got 40% of the CPU time"],
                                "spread": {"t@128": 0.7, "T_pf@32": 0.1}, "calibrated_at": "x"}))
    for rid, p, m in ((0, 100.0, 250.0), (1, 300.0, 120.0), (2, 100.0, 100.0)):
        st.apply(RequestEnd(request_id=rid, predicted_ms=p, latency_ms=m))
    text, tip = quality_text(st)
    assert "contended" in text and "spread ≤ 70%" in text and "Recalibrate" in text
    assert "40% of the CPU" in tip and "t@128 70%" in tip and "(t@128)" in tip
    assert abs(st.prediction_mape() - (0.6 + 1.5 + 0) / 3) < 1e-9
    assert "not in this recording" in quality_text(_header_only())[0]


def test_quality_line_says_which_v_of_k_the_rounds_corrected():
    st = SessionState()
    st.apply(RunHeader(profile={"contended": False, "spread": {"V8": 0.05}, "calibrated_at": "x"}))
    st.apply(RequestEnd(request_id=0, predicted_ms=100.0, latency_ms=100.0))
    assert "corrected" not in quality_text(st)[0]
    st.apply(RequestEnd(request_id=1, predicted_ms=100.0, latency_ms=100.0, cost_corrections={"V(8)": 0.45}))
    text, tip = quality_text(st)
    assert "corrected by rounds: V(8) x0.45" in text and "shape_correction" in tip


def _header_only():
    st = SessionState()
    st.apply(RunHeader())
    return st


def test_recalibrate_starts_a_session_with_a_new_profile(qtbot, win, monkeypatch):
    import app.worker  # noqa: F401  (the worker imports load_or_calibrate when it recalibrates)
    import rakv.decide.calibration as costs

    seen = {}
    real = costs.load_or_calibrate

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(costs, "load_or_calibrate", spy)
    old = win.worker.profile
    assert win.act_recalibrate.isEnabled()
    with qtbot.waitSignal(win.modelsLoaded, timeout=T_MS):
        win.recalibrate(quick=True)
    qtbot.waitUntil(lambda: win.live.header is not None, timeout=T_MS)
    assert seen["force"] is True and win.worker.profile is not old
    assert win.live.header.profile["calibrated_at"] == win.worker.profile.calibrated_at
    assert run(qtbot, win) is not None


# ----------------------------------------------------------------------------- settings
def test_restored_settings_are_shown_with_a_reset(qtbot, tmp_path, calibrated, errors):
    s = Settings(tmp_path / "restored.ini")
    s.set("run/max_new_tokens", 24)
    s.set("controls/k_set", "0,4")
    s.set("controls/budget_mib", 4096)
    s.set("run/policy", "adaptive")                  # the default: not listed
    s.sync()
    w = make_window(qtbot, tmp_path, calibrated, "restored.ini")
    try:
        note = w.settings_note
        assert note.isVisible()
        for item in ("max new tokens 24", "K {0, 4}", "budget 4096 MiB"):
            assert item in note.text()
        assert "policy" not in note.text() and "Reset settings" in note.text()
        w._settings_link("reset")
        assert not note.isVisible()
        assert w.run_panel.max_new.value() == Settings.DEFAULTS["run/max_new_tokens"]
        assert w.controls.k_set() == (0, 1, 2, 4, 6, 8) and w.controls.budget_mib() == 512
        assert w.worker.controls.k_set == (0, 1, 2, 4, 6, 8)
        assert Settings(tmp_path / "restored.ini").non_defaults() == {}
    finally:
        w.shutdown()


def test_defaults_show_no_notice(win):
    assert not win.settings_note.isVisible() and win.restored_settings() == []


# ----------------------------------------------------------------------------- paper cuts
def test_replay_starts_at_a_speed_one_can_watch(qtbot, win):
    run(qtbot, win)
    win.settings.set("replay/speed", "max")          # left by a scripted replay
    assert win.open_recording(str(win.worker.recording), play=True)
    assert win.replay_bar.speed.currentText() == Settings.DEFAULTS["replay/speed"]
    assert win.replayer.playing() and win.replayer.pos < win.replayer.total
    win.leave_replay()


def test_measure_dialog_and_status_bar_agree(win):
    win.measure_dialog = QProgressDialog("", "Cancel", 0, 0, win)
    try:
        win._on_measure_progress(1, 15, "r=0, k=2")
        assert "run 2 of 15" in win.measure_dialog.labelText() and "run 2 of 15" in win.msg.text()
        win._on_measure_progress(15, 15, "")
        assert "run 15 of 15" in win.measure_dialog.labelText() and "run 15 of 15" in win.msg.text()
    finally:
        win.measure_dialog.close()
        win.measure_dialog = None


def test_display_without_an_x_server_is_one_line():
    env = {"DISPLAY": ":97"}
    msg = desktop.x_server_problem(env, "linux", answers=lambda ep: False)
    assert msg.startswith("DISPLAY=:97 names no running X server") and "\n" not in msg
    assert "/tmp/.X11-unix/X97" in msg and "QT_QPA_PLATFORM=offscreen" in msg
    assert desktop.x_server_problem(env, "linux", answers=lambda ep: True) is None
    for quiet in ({"DISPLAY": ":97", "QT_QPA_PLATFORM": "offscreen"}, {"DISPLAY": ":97", "WAYLAND_DISPLAY": "w-0"},
                  {}):
        assert desktop.x_server_problem(quiet, "linux", answers=lambda ep: False) is None
    assert desktop.x_endpoint(":1.0") == ("unix", "/tmp/.X11-unix/X1")
    assert desktop.x_endpoint("unix:2") == ("unix", "/tmp/.X11-unix/X2")
    assert desktop.x_endpoint("box:3") == ("tcp", ("box", 6003))
    assert desktop.x_endpoint("nonsense") is None


def test_x_server_check_over_a_real_socket(tmp_path):
    """A TCP display on loopback: answered while something listens, not after."""
    srv = None
    for n in range(90, 140):
        try:
            srv = socket.create_server(("127.0.0.1", 6000 + n))
            break
        except OSError:
            continue
    if srv is None:
        pytest.skip("no free port in 6090..6139")
    with srv:
        assert desktop.x_server_problem({"DISPLAY": f"127.0.0.1:{n}"}, "linux") is None
    assert "names no running X server" in desktop.x_server_problem({"DISPLAY": f"127.0.0.1:{n}"}, "linux")


def test_explorer_exits_2_on_a_display_no_server_answers(monkeypatch, capsys):
    import app.main as m

    monkeypatch.setattr(desktop, "check", lambda env=None: None)
    monkeypatch.setattr(desktop, "x_answers", lambda ep, timeout=2.0: False)
    monkeypatch.setenv("DISPLAY", ":97")
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr(desktop.sys, "platform", "linux")
    assert m.main(["--exit-after-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names no running X server" in err[0]


def test_acceptance_request_labels_never_overlap(qtbot):
    """Request boundaries close together on a narrow plot: one label, not "req 1req 2"; wide: all."""
    from app.panels.acceptance import LABEL_GAP_PX, AcceptancePanel
    from rakv.records import read_recording

    root = Path(__file__).resolve().parents[2]
    st = SessionState()
    st.apply_all(read_recording(root / "resources" / "example.jsonl"))
    p = AcceptancePanel()
    qtbot.addWidget(p)
    p.show()
    for width, want_all in ((150, False), (1600, True)):
        p.resize(width, 300)
        qtbot.waitUntil(lambda: abs(p.width() - width) < 2, timeout=5000)
        p.refresh(st)
        p._label_bounds()
        labels = p.snapshot()["bound_labels"]
        shown = [ln.value() for ln, t in zip(p._bounds, labels) if t]
        vb = p.plot.getPlotItem().vb
        (x0, x1), _ = vb.viewRange()
        px = vb.width() / (x1 - x0)
        assert labels[0] == "req 0" and all(b - a >= LABEL_GAP_PX / px - 1e-9 for a, b in zip(shown, shown[1:]))
        gaps = [b.value() - a.value() for a, b in zip(p._bounds, p._bounds[1:])]
        assert want_all == (min(gaps) * px >= LABEL_GAP_PX)           # the sizes test both cases
        assert (labels == ["req 0", "req 1", "req 2"]) == want_all


def test_none_survives_pysides_reference_leak(qtbot):
    """PySide6 drops a reference to None per void call on CPython 3.11; the app pins None first."""
    import sys

    from PySide6.QtWidgets import QLabel

    from app.noneguard import PINNED

    if sys.version_info >= (3, 12):
        pytest.skip("None is immortal from CPython 3.12")
    assert sys.getrefcount(None) > PINNED // 2
    lab = QLabel()
    qtbot.addWidget(lab)
    for _ in range(200):
        lab.setText("x")
    assert sys.getrefcount(None) > PINNED // 2        # whatever the leak takes, far from zero
