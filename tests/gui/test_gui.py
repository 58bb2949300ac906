"""GUI tests (pytest-qt, offscreen) on tiny random models injected into the worker."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

pytest.importorskip("pytestqt")


from app.settings import Settings  # noqa: E402
from app.window import MainWindow, about_text  # noqa: E402
from rakv.drafts.model import ModelDraft  # noqa: E402
from rakv.records import CSV_COLUMNS, Decision, RequestEnd, Round, read_recording  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b):"
ROOT = Path(__file__).resolve().parents[2]
T = 30_000   # generous signal timeout (ms); runs take well under a second


@pytest.fixture
def win(qtbot, tmp_path, calibrated, errors):
    w = MainWindow(Settings(tmp_path / "settings.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.show()
    target, draft, profile = calibrated
    with qtbot.waitSignal(w.modelsLoaded, timeout=T):
        w.use_models(target, ModelDraft(draft), profile)
    qtbot.waitUntil(lambda: w.live.header is not None, timeout=T)    # the header follows "loaded"
    w.run_panel.prompt.setPlainText(PROMPT)
    w.run_panel.max_new.setValue(24)
    w.run_panel.policy.setCurrentText("adaptive")
    yield w
    w.shutdown()


def run(qtbot, w, prompt=None, policy=None, max_new=None) -> RequestEnd:
    if prompt is not None:
        w.run_panel.prompt.setPlainText(prompt)
    if policy is not None:
        w.run_panel.policy.setCurrentText(policy)
    if max_new is not None:
        w.run_panel.max_new.setValue(max_new)
    with qtbot.waitSignal(w.runFinished, timeout=T) as blocker:
        w.run()
    w.redraw()
    return blocker.args[0]


def decisions(w, rid) -> list[Decision]:
    return [r for r in w.live.records if isinstance(r, Decision) and r.request_id == rid and r.round < 0]


# ---------------------------------------------------------------------------------------------
def test_window_opens(win):
    assert win.windowTitle().startswith("RAKV Explorer")
    assert set(win.docks) == {"run", "controls", "cache", "costs", "acceptance", "timeline"}
    assert win.act_open.shortcut().toString() == "Ctrl+O"
    assert win.act_run.shortcut().toString() == "Ctrl+R"
    assert win.act_stop.shortcut().toString() == "Esc"
    assert win.act_export.shortcut().toString() == "Ctrl+E"
    text = about_text()
    for name in ("PySide6", "pyqtgraph", "torch", "transformers"):
        assert name in text
    assert win.live.header is not None          # the engine's run header arrived


def test_run_updates_every_panel(qtbot, win, tmp_path):
    end = run(qtbot, win)
    assert end is not None and len(end.output_ids) >= 1
    snap = win.panel_snapshot()
    st = win.live
    # token stream: prompt + generated, every token with a provenance
    assert snap["tokens"]["n"] == st.prompt_tokens + len(end.output_ids)
    assert "done" in snap["tokens"]["title"]
    assert PROMPT[:20] in snap["tokens"]["text"]
    assert {t.kind for t in st.tokens[st.prompt_tokens:]} <= {"target", "draft", "stored"}
    # cache panel
    assert snap["cache"]["hit"] == f"hit q = 0 of P = {st.prompt_tokens} tokens"
    assert snap["cache"]["entries"] == "1"
    assert "512 MiB" in snap["cache"]["bytes"]
    # action costs: every (r, k) of {0,1} x K, chosen one marked, measured beside it
    bars = snap["costs"]["bars"]
    assert len(bars) == 12 and {(r, k) for r, k, *_ in bars} == {(r, k) for r in (0, 1) for k in (0, 1, 2, 4, 6, 8)}
    assert snap["costs"]["chosen"] >= 0
    assert snap["costs"]["measured"] == pytest.approx(end.latency_ms)
    # acceptance + timeline
    assert snap["acceptance"]["n"] == end.rounds == snap["timeline"]["n"]
    assert snap["acceptance"]["stars"] == decisions(win, end.request_id)[-1].alpha_star
    assert "tok/s" in win.stats.text() and "TTFT" in win.stats.text() and "1 thread" in win.stats.text()
    # hover text of a generated token names its round, k and timing
    tip = win.tokens.tooltip(st.prompt_tokens + 1)
    assert re.search(r"round \d+ \(\w+, k=\d+\)", tip) and "ms" in tip
    # the run was recorded
    rec = Path(win.worker.recording)
    assert rec.parent == tmp_path / "sessions"
    assert any(isinstance(r, RequestEnd) for r in read_recording(rec))

    # exact repeat: all prompt tokens reused, first token from stored logits
    end2 = run(qtbot, win)
    assert end2.exact_repeat and end2.output_ids == end.output_ids
    st = win.live
    assert all(t.kind == "reused" for t in st.tokens[:st.prompt_tokens])
    assert st.tokens[st.prompt_tokens].kind == "stored"
    assert win.panel_snapshot()["cache"]["hit"] == f"hit q = {st.prompt_tokens} of P = {st.prompt_tokens} tokens"

    # partial hit: the boundary token is recomputed (kv: reuse forced on, k = 0)
    run(qtbot, win, prompt=PROMPT + " return a + b", policy="kv")
    st = win.live
    kinds = [t.kind for t in st.tokens[:st.prompt_tokens]]
    q = st.cache.hit_tokens
    assert q > 0 and kinds[: q - 1] == ["reused"] * (q - 1) and kinds[q - 1] == "boundary"
    assert win.panel_snapshot()["cache"]["hits"] == 3


def test_hover_shows_token_details(qtbot, win):
    from PySide6.QtCore import QEvent
    from PySide6.QtGui import QHelpEvent, QTextCursor
    from PySide6.QtWidgets import QApplication, QToolTip

    run(qtbot, win)
    win.central.setCurrentWidget(win.tokens)          # the Token stream tab (Chat is the first)
    view = win.tokens.view
    cur = QTextCursor(view.document())
    cur.movePosition(QTextCursor.MoveOperation.End)
    cur.movePosition(QTextCursor.MoveOperation.Left, n=2)           # inside the last output token
    pos = view.cursorRect(cur).center()
    ev = QHelpEvent(QEvent.Type.ToolTip, pos, view.viewport().mapToGlobal(pos))
    QApplication.sendEvent(view.viewport(), ev)
    assert re.search(r"round \d+ \(\w+, k=\d+\)", QToolTip.text())


def test_settings_persist(qtbot, win, tmp_path):
    win.controls.budget.setValue(1024)
    win.run_panel.prompt.setPlainText("persisted prompt")
    win.controls.k_boxes[8].setChecked(False)
    win.save_settings()
    w2 = MainWindow(Settings(tmp_path / "settings.ini"), tmp_path / "sessions2")
    qtbot.addWidget(w2)
    try:
        assert w2.controls.budget_mib() == 1024
        assert w2.run_panel.prompt_text() == "persisted prompt"
        assert w2.controls.k_set() == (0, 1, 2, 4, 6)
        assert w2.worker.controls.budget_mib == 1024
    finally:
        w2.shutdown()


def test_stop_mid_run(qtbot, win, monkeypatch):
    import time

    import rakv.decoding as dec

    slow = dec.decode_one

    def decode_one_slowly(*a, **kw):      # make the run long enough to stop in the middle
        time.sleep(0.01)
        return slow(*a, **kw)

    monkeypatch.setattr(dec, "decode_one", decode_one_slowly)
    win.run_panel.max_new.setValue(200)
    win.run_panel.policy.setCurrentText("ar")
    with qtbot.waitSignal(win.worker.record, timeout=T,
                          check_params_cb=lambda r: isinstance(r, Round) and r.index >= 3):
        win.run()
    assert win.run_panel.stop.isEnabled() and win.act_stop.isEnabled()
    with qtbot.waitSignal(win.runFinished, timeout=T) as b:
        win.stop()
    end = b.args[0]
    assert end.stopped == "stop" and len(end.output_ids) < 200
    assert win.run_panel.run.isEnabled() and not win.run_panel.stop.isEnabled()


def test_live_controls_act_on_next_decision(qtbot, win):
    eng = win.worker.engine
    # K set: boxes -> engine (directly, under the engine's lock)
    for k, cb in win.controls.k_boxes.items():
        cb.setChecked(k in (0, 2))
    assert eng.k_set == (0, 2)
    end = run(qtbot, win)
    d = decisions(win, end.request_id)[-1]
    assert {c["k"] for c in d.candidates} == {0, 2}
    # custom K set overrides the boxes
    win.controls.k_custom.setText("0,3")
    win.controls.k_custom.editingFinished.emit()
    assert eng.k_set == (0, 3)
    # budget: slider -> worker queue -> engine; r = 1 becomes infeasible at 0 MiB
    win.controls.budget.setValue(0)
    qtbot.waitUntil(lambda: eng.store.budget == 0, timeout=T)
    end = run(qtbot, win)
    d = decisions(win, end.request_id)[-1]
    r1 = [c for c in d.candidates if c["reuse"] == 1]
    assert r1 and not any(c["feasible"] for c in r1) and all("budget" in c["reason"] for c in r1)
    assert d.action["reuse"] == 0
    snap = win.panel_snapshot()["costs"]
    assert any(not feasible for *_, feasible in snap["bars"])
    assert "infeasible" in win.costs.tooltip_at(next(i for i, b in enumerate(snap["bars"]) if not b[3]))
    # force (r, k)
    win.controls.force_k.setValue(3)
    win.controls.force_on.setChecked(True)
    assert eng.force == (0, 3)
    end = run(qtbot, win)
    d = decisions(win, end.request_id)[-1]
    assert d.reason == "forced" and d.action == {"reuse": 0, "k": 3}
    win.controls.force_on.setChecked(False)
    assert eng.force is None
    # granularity
    win.controls.granularity.setCurrentIndex(win.controls.granularity.findData("request"))
    assert eng.granularity == "request"


def test_replay_reproduces_live_panels(qtbot, win):
    run(qtbot, win)
    run(qtbot, win, prompt=PROMPT + " return a + b")
    live = win.panel_snapshot()
    path = win.worker.recording
    assert win.open_recording(str(path), play=False)
    assert win.state is not win.live and win.replay_tb.isVisibleTo(win)
    with qtbot.waitSignal(win.replayFinished, timeout=T):
        win.replay_bar.speed.setCurrentText("max")
        win.replayer.play()
    assert win.panel_snapshot() == live
    # scrub back and step forward
    win.replay_bar.scrub.setValue(3)
    assert win.replayer.pos == 3 and len(win.state.records) == 3
    win.replayer.step()
    assert win.replayer.pos == 4
    win.replayer.finish()
    assert win.panel_snapshot() == live
    win.leave_replay()
    assert win.state is win.live and not win.replay_tb.isVisibleTo(win)


def test_csv_one_row_per_request(qtbot, win, tmp_path):
    run(qtbot, win)
    run(qtbot, win)
    out = tmp_path / "timings.csv"
    assert win.export_csv(str(out)) == 2
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert list(rows[0].keys()) == [c for c, _ in CSV_COLUMNS]
    assert [int(r["request_id"]) for r in rows] == [0, 1]
    assert rows[1]["exact_repeat"] == "1"
    pngs = win.export_plots(str(tmp_path / "plots"))
    assert len(pngs) == 4 and all(Path(p).stat().st_size > 1000 for p in pngs)


def test_engine_error_shows_dialog_and_next_run_works(qtbot, win, errors, monkeypatch):
    end = run(qtbot, win, prompt="   ")                 # EngineError: empty prompt
    assert end is None and errors and "empty prompt" in errors[-1]
    eng = win.worker.engine
    real = eng.generate
    calls = {"n": 0}

    def broken(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated failure in a forward")
        return real(*a, **kw)

    monkeypatch.setattr(eng, "generate", broken)
    assert run(qtbot, win, prompt=PROMPT) is None
    assert "simulated failure" in errors[-1]
    assert win.isVisible() and win.run_panel.run.isEnabled()
    end = run(qtbot, win)
    assert end is not None and end.stopped in ("eos", "max_new_tokens")
    # an exception escaping a slot goes through sys.excepthook -> dialog
    win.excepthook(ValueError, ValueError("boom"), None)
    assert errors[-1] == "ValueError: boom"


def test_bad_model_shows_dialog_and_skips_the_run(qtbot, win, errors, calibrated):
    win.run_panel.set_pair("/nonexistent/model-dir", "none")
    win.preloaded = False                      # as if the user picked a pair in the GUI
    end = run(qtbot, win)
    assert end is None and len(errors) == 1 and "model path not found" in errors[0]
    target, draft, profile = calibrated
    with qtbot.waitSignal(win.modelsLoaded, timeout=T):
        win.use_models(target, ModelDraft(draft), profile)
    assert run(qtbot, win) is not None


def test_corrupt_recording_gives_clear_message(win, errors, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good_header = (ROOT / "resources" / "example.jsonl").read_text().splitlines()[0]
    bad.write_text(good_header + "\n{not json\n")
    assert not win.open_recording(str(bad))
    assert errors and f"{bad}:2: not valid JSON" in errors[-1]
    assert win.replayer is None and win.state is win.live
    assert not win.open_recording(str(tmp_path / "missing.jsonl"))
    assert "recording not found" in errors[-1]


# ---------------------------------------------------------------------------------------------
# Measure every action
def measure(qtbot, w, repeats=2):
    with qtbot.waitSignal(w.measureFinished, timeout=T) as blocker:
        w.measure_all(repeats)
    w.redraw()
    return blocker.args[0]


def test_measure_every_action(qtbot, win, tmp_path):
    from rakv.records import ORACLE_CSV_COLUMNS, OracleResult

    for k, cb in win.controls.k_boxes.items():
        cb.setChecked(k in (0, 2))
    first = run(qtbot, win)
    eng = win.worker.engine
    next_id, entries = eng._next_id, len(eng.store)
    progress = []
    win.worker.measureProgress.connect(lambda d, t, w: progress.append((d, t)))
    res = measure(qtbot, win)
    assert isinstance(res, OracleResult) and res.exact
    assert [(a["reuse"], a["k"]) for a in res.actions] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert progress[-1] == (10, 10)                       # (4 actions + adaptive) x 2 repeats
    assert win.measure_dialog is None and not win.running and win.run_panel.run.isEnabled()
    assert win.act_measure.isEnabled() and "regret" in win.msg.text()
    # nothing learned or stored; the result is in the session state
    assert eng._next_id == next_id and len(eng.store) == entries
    assert win.live.oracle is res
    # the costs panel switched to the measured view: measured beside each prediction, oracle, regret
    snap = win.panel_snapshot()["costs"]
    assert snap["view"] == 2
    assert [m[:2] for m in snap["oracle"]["measured"]] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert all(lo <= med <= hi for *_, med, lo, hi in snap["oracle"]["measured"])
    assert snap["oracle"]["best"] == res.oracle and "Regret" in snap["oracle"]["regret"]
    assert f"{res.regret * 100:+.1f}%" in snap["oracle"]["regret"]
    assert "runs" in win.costs.tooltip_at(0) and "measured median" in win.costs.tooltip_at(0)
    # saved with the session, replayed into the same panel
    recs = read_recording(win.worker.recording)
    assert sum(isinstance(r, OracleResult) for r in recs) == 1
    live = win.panel_snapshot()
    assert win.open_recording(str(win.worker.recording), play=False)
    with qtbot.waitSignal(win.replayFinished, timeout=T):
        win.replay_bar.speed.setCurrentText("max")
        win.replayer.play()
    assert win.panel_snapshot() == live
    # exported with the session timings: OUT and OUT.oracle.csv
    out = tmp_path / "timings.csv"
    assert win.export_csv(str(out)) == 1
    with open(tmp_path / "timings.oracle.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [c for c, _ in ORACLE_CSV_COLUMNS] and len(rows) == 4
    win.leave_replay()
    # the next request is the session's next one, and the panel goes back to its decision
    end = run(qtbot, win)
    assert end.request_id == first.request_id + 1 and end.output_ids == first.output_ids
    assert win.panel_snapshot()["costs"]["view"] == 0


def test_measure_cancel(qtbot, win, monkeypatch):
    import time

    import rakv.decoding as dec

    slow = dec.decode_one

    def decode_one_slowly(*a, **kw):
        time.sleep(0.005)
        return slow(*a, **kw)

    from PySide6.QtWidgets import QPushButton

    monkeypatch.setattr(dec, "decode_one", decode_one_slowly)
    win.controls.k_custom.setText("0,2")
    win.controls.k_custom.editingFinished.emit()
    with qtbot.waitSignal(win.worker.measureProgress, timeout=T, check_params_cb=lambda d, t, w: d >= 2):
        win.measure_all(3)
    assert win.measuring and win.measure_dialog is not None and win.act_stop.isEnabled()
    with qtbot.waitSignal(win.measureFinished, timeout=T) as b:
        win.measure_dialog.findChild(QPushButton).click()        # the dialog's Cancel
    assert b.args[0] is None and "cancelled" in win.msg.text()
    assert win.live.oracle is None and win.measure_dialog is None
    end = run(qtbot, win)                   # a cancel does not leak into the next request
    assert end is not None and end.stopped in ("eos", "max_new_tokens") and end.request_id == 0


def test_measure_errors_become_dialogs(qtbot, win, errors, monkeypatch):
    import rakv.decide.oracle

    win.run_panel.prompt.setPlainText("   ")
    assert measure(qtbot, win) is None
    assert errors and "empty prompt" in errors[-1]
    win.run_panel.prompt.setPlainText(PROMPT)
    monkeypatch.setattr(rakv.decide.oracle, "check_exact", lambda runs: (False, "OUTPUT MISMATCH: simulated"))
    res = measure(qtbot, win, repeats=1)
    assert res is not None and not res.exact and errors[-1] == "OUTPUT MISMATCH: simulated"
    assert "simulated" in win.panel_snapshot()["costs"]["oracle"]["regret"]
    assert win.run_panel.run.isEnabled()


def test_scripted_replay_screenshot(qtbot, tmp_path, monkeypatch):
    """`rakv-explorer --replay FILE --screenshot PNG --exit-after-run` on the shipped example."""
    import sys

    import torch

    from app import main as app_main

    monkeypatch.setenv("RAKV_SETTINGS", str(tmp_path / "s.ini"))
    monkeypatch.setenv("RAKV_SESSIONS", str(tmp_path / "sessions"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    threads = torch.get_num_threads()
    png = tmp_path / "replay.png"
    try:
        rc = app_main.main(["--replay", str(ROOT / "resources" / "example.jsonl"), "--screenshot", str(png),
                            "--exit-after-run"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0 and png.stat().st_size > 10_000


@pytest.mark.parametrize("size", [(340, 260), (720, 460)])
@pytest.mark.parametrize("chosen", [None, (0, 0), (1, 8)])
def test_costs_labels_above_the_bars_fit(qtbot, size, chosen):
    """The action-cost panel's labels above the bars (r=0 / r=1, "measured N ms") lie inside the
    plot, clear of every bar and of each other: at the size the panel gets on a 1280x720 screen and
    at a larger one, with the chosen action in the middle or at either end, and after a resize."""
    from dataclasses import replace

    from PySide6.QtCore import QPointF

    from app.panels.costs import CostsPanel
    from app.state import SessionState

    state = SessionState()
    state.apply_all(read_recording(ROOT / "resources" / "example.jsonl"))
    if chosen is not None:
        state.decision = replace(state.decision, action={"reuse": chosen[0], "k": chosen[1]})
    panel = CostsPanel()
    qtbot.addWidget(panel)
    panel.resize(*size)
    panel.show()
    qtbot.wait(50)
    panel.refresh(state)
    for grow in (0, 80):
        panel.resize(size[0] + grow, size[1] + grow)
        qtbot.wait(50)
        vb = panel.plot.getPlotItem().vb
        view = vb.sceneBoundingRect()
        label = panel.mtext.sceneBoundingRect()
        assert panel.mtext.toPlainText().startswith("measured ") and view.contains(label), (view, label)
        groups = [g.sceneBoundingRect() for g in panel._group_labels]
        assert len(groups) == 2 and all(view.contains(g) and not g.intersects(label) for g in groups), (
            view, label, groups, [(view.contains(g), g.intersects(label), g.bottom(), label.top()) for g in groups])
        top = max(c["predicted_ms"] for c in panel._cands + [{"predicted_ms": panel._measured}])
        bars_top = vb.mapViewToScene(QPointF(0, top)).y()          # scene y grows downwards
        assert max(r.bottom() for r in [label, *groups]) <= bars_top + 1, (label, groups, bars_top)


def test_engine_never_imports_qt():
    for p in (ROOT / "rakv").glob("*.py"):
        src = p.read_text()
        assert not re.search(r"^\s*(from|import)\s+(PySide6|PyQt|pyqtgraph|app)\b", src, re.M), p



def test_garbage_cycles_are_collected_on_the_gui_thread_only(qtbot):
    """While a window lives, automatic collection is off and a timer on the GUI thread collects
    (app/gcguard.py): cycles a worker thread leaves, past the collector's threshold, are finalized
    on the GUI thread, never on the worker's (where finalizing Qt objects hung a run once)."""
    import gc
    import threading

    from app.gcguard import GuiThreadGC

    seen = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            seen.append(threading.current_thread() is threading.main_thread())

    kept = []
    gc.enable()                 # (the GUI tests run with it off: tests/conftest.py; this one starts on)
    g = GuiThreadGC(interval_ms=20)
    try:
        assert not gc.isenabled()

        def work():             # a worker allocating past gen 0's threshold, as the engine's does
            for _ in range(3):
                Cycle()
            kept.append([[] for _ in range(5 * gc.get_threshold()[0])])

        t = threading.Thread(target=work)
        t.start()
        t.join()
        qtbot.waitUntil(lambda: len(seen) >= 3, timeout=5000)
        assert all(seen)
    finally:
        g.stop()
    assert gc.isenabled()                         # the last guard restores what was there before it
    gc.disable()
    g2 = GuiThreadGC(interval_ms=20)
    g2.stop()
    assert not gc.isenabled()                     # off before: off after
