"""The Batch panel and the panels that follow the selected request: interleaved records of several
requests open at once (``rakv serve --parallel``: Step records between their rounds) fed live and
replayed, and a real in-process ``rakv serve --parallel 3`` recording replayed. Offscreen, waiting
on signals and states, never on time."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QMessageBox  # noqa: E402

from app.settings import Settings  # noqa: E402
from app.state import SessionState  # noqa: E402
from app.window import MainWindow  # noqa: E402
from rakv.records import (CacheLookup, Decision, Recorder, RequestEnd, RequestStart, Round, RunHeader,  # noqa: E402
                          Step, read_recording)

T = 60_000
P = {1: 5, 2: 9, 3: 14}            # prompt tokens per request
K = {1: 2, 2: 0, 3: 4}             # each request's k
ROUNDS = {1: 3, 2: 2, 3: 4}        # decoding rounds after the prefill (request 2 ends first, then 1, then 3)


def out_id(rid: int, j: int) -> int:
    return 1000 * rid + j           # every request's tokens apart: a token in the wrong request shows


def interleaved(predicted: bool = True) -> list:
    """Three requests started together, their prompts fed in one shared step, then decode / verify
    steps with each request's rows (1 + k), their Rounds and Decisions interleaved; request 2 ends
    first, then 1, then 3."""
    t = iter(x / 100 for x in range(1, 10_000))
    recs: list = [RunHeader(t=0.0, target={"name": "tiny"}, draft={"name": "ngram"})]
    for rid in (1, 2, 3):
        recs.append(RequestStart(t=next(t), request_id=rid, prompt=f"prompt of request {rid}",
                                 prompt_ids=[100 * rid + p for p in range(P[rid])], prompt_tokens=P[rid],
                                 max_new_tokens=16, policy="adaptive"))
        cands = [{"reuse": 0, "k": k, "predicted_ms": 10.0 + k, "feasible": True, "reason": ""} for k in (0, 2, 4)]
        recs.append(Decision(t=next(t), request_id=rid, round=-1, candidates=cands, action={"reuse": 0, "k": K[rid]},
                             alpha=0.5, alpha_star={"2": 0.3, "4": 0.45}, reason="argmin"))
        recs.append(CacheLookup(t=next(t), request_id=rid, prompt_tokens=P[rid], budget=1 << 20))
    step = 1
    recs.append(Step(t=next(t), step=step, requests=[[rid, P[rid]] for rid in (1, 2, 3)], ms=30.0))
    emitted = {rid: [] for rid in P}
    for rid in (3, 1, 2):                                   # the prefills' first tokens, out of order
        emitted[rid].append(out_id(rid, 0))
        recs.append(Round(t=next(t), request_id=rid, index=0, kind="prefill", emitted=[out_id(rid, 0)],
                          provenance=["target"], round_ms=30.0))
    for i in range(1, max(ROUNDS.values()) + 1):
        live = [rid for rid in (2, 3, 1) if i <= ROUNDS[rid]]
        step += 1
        st = Step(t=next(t), step=step, requests=[[rid, 1 + K[rid]] for rid in live], ms=8.0 + i)
        if predicted and i == 1:
            st.predicted_ms = 9.5            # (the field the coordinator may add: read where present)
        recs.append(st)
        for rid in live:
            n = 1 + (K[rid] // 2)            # accepted drafts + the bonus token
            ids = [out_id(rid, len(emitted[rid]) + j) for j in range(n)]
            emitted[rid] += ids
            kind = "spec" if K[rid] else "ar"
            recs.append(Round(t=next(t), request_id=rid, index=i, kind=kind, k=K[rid], drafted=K[rid],
                              accepted=n - 1, emitted=ids, provenance=["draft"] * (n - 1) + ["target"],
                              draft_ms=1.0, verify_ms=5.0 + K[rid], round_ms=6.0 + K[rid], alpha=0.1 * rid))
            if i == 1 and rid == 3:           # a per-round re-decision of request 3
                recs.append(Decision(t=next(t), request_id=3, round=2, action={"reuse": 0, "k": 4}, alpha=0.3,
                                     reason="argmin"))
            if i == ROUNDS[rid]:
                recs.append(RequestEnd(t=next(t), request_id=rid, output_ids=list(emitted[rid]), text=f"answer {rid}",
                                       prompt_tokens=P[rid], latency_ms=100.0 * rid, stopped="max_new_tokens",
                                       predicted_ms=90.0 * rid, tokens_per_s=10.0))
    return recs


@pytest.fixture
def win(qtbot, tmp_path, monkeypatch):
    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "settings.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.show()
    yield w
    w.shutdown()


def feed_until(win, recs, i0: int, cond) -> int:
    """Feed records from ``i0`` through the window's live path until ``cond(record)``; the next index."""
    for i in range(i0, len(recs)):
        win._on_record(recs[i])
        if cond(recs[i]):
            return i + 1
    raise AssertionError("the condition never held")


def click_request(qtbot, win, rid: int) -> None:
    """Click request ``rid``'s row in the Batch panel's table, as a user would."""
    panel = win.batch
    win.batch_dock.raise_()
    qtbot.waitUntil(lambda: panel.table.isVisible(), timeout=T)
    row = panel._ids.index(rid)
    rect = panel.table.visualItemRect(panel.table.item(row, 2))
    with qtbot.waitSignal(panel.requestSelected, timeout=T) as blocker:
        qtbot.mouseClick(panel.table.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert blocker.args == [rid]


def views_clean(st: SessionState) -> None:
    """Every request's tokens are its own: its prompt, then its own outputs (= its RequestEnd's)."""
    for rid, v in st.views.items():
        assert [t.id for t in v.tokens[: v.prompt_tokens]] == [100 * rid + p for p in range(P[rid])]
        outs = [t.id for t in v.tokens[v.prompt_tokens:]]
        assert all(x // 1000 == rid for x in outs), (rid, outs)
        if v.end is not None:
            assert outs == v.end.output_ids


def test_batch_panel_lists_the_active_requests_and_the_panels_follow_the_selection(qtbot, win):
    recs = interleaved()
    i = feed_until(win, recs, 0, lambda r: isinstance(r, Step))
    win.redraw()
    snap = win.panel_snapshot()
    b = snap["batch"]
    assert b["active"] == [1, 2, 3]
    assert b["rows"] == {1: "5", 2: "9", 3: "14"}              # the prompts' shared step
    assert b["k"] == {1: "2", 2: "0", 3: "4"}                  # from each one's decision
    assert b["shown"] == 3 and b["follow"]                     # the newest by default
    assert snap["tokens"]["title"].startswith("Request 3 ")
    assert win.batch_dock.isVisible()                          # its tab came forward at the first step
    # the first decode step: rows 1 + k each, measured against predicted
    i = feed_until(win, recs, i, lambda r: isinstance(r, Step))
    win.redraw()
    b = win.panel_snapshot()["batch"]
    assert b["rows"] == {1: "3", 2: "1", 3: "5"}
    assert "predicted 9.5 ms" in b["info"] and b["predicted"] == 1 and b["steps"] == 2
    assert b["bars"] == 6 and b["outlined"] == 2              # 3 requests x 2 steps, request 3's outlined
    # click request 1: every request panel shows it
    click_request(qtbot, win, 1)
    snap = win.panel_snapshot()
    assert snap["batch"]["shown"] == 1 and not snap["batch"]["follow"]
    assert snap["tokens"]["title"].startswith("Request 1 ")
    assert win.costs.info.text().startswith("request 1 ")
    assert snap["timeline"]["xlabel"] == "round (request 1)" and snap["acceptance"]["xlabel"] == "round (request 1)"
    n1 = snap["tokens"]["n"]
    # request 3's round (and its re-decision) arrive while request 1 is shown: they go to request 3
    i = feed_until(win, recs, i, lambda r: isinstance(r, Decision) and r.request_id == 3)
    win.redraw()
    snap = win.panel_snapshot()
    assert snap["tokens"]["title"].startswith("Request 1 ") and snap["tokens"]["n"] == n1
    assert win.live.views[3].round_decision is not None and win.live.views[1].round_decision is None
    assert win.batch.snapshot()["k"][3] == "4"
    views_clean(win.live)
    # to the end: 3 active, then 2 (request 2 ended), then none; request 1 stays shown (done)
    seen = set()
    for r in recs[i:]:
        win._on_record(r)
        if isinstance(r, (Step, RequestEnd)):
            win.redraw()
            seen.add(tuple(win.batch.snapshot()["active"]))
        if isinstance(r, RequestEnd):           # the chat shows an answer that ends before a later request's
            assert f"answer {r.request_id}" in win.chat.view.toPlainText()
    assert (1, 3) in seen and (3,) in seen
    win.redraw()
    snap = win.panel_snapshot()
    assert snap["batch"]["active"] == [] and snap["batch"]["shown"] == 1
    assert "done" in snap["batch"]["shown_text"] and "done (max_new_tokens)" in snap["tokens"]["title"]
    assert not win.live.running
    views_clean(win.live)
    # Follow the newest: back to request 3
    with qtbot.waitSignal(win.batch.requestSelected, timeout=T):
        win.batch.follow.setChecked(True)
    assert win.panel_snapshot()["tokens"]["title"].startswith("Request 3 ")


def test_batch_plot_with_predictions_and_gaps(qtbot):
    """Predicted ms on some steps, steps not shared in between (gaps in the step numbers): drawn,
    the lines broken at the gaps; nothing shared yet: the note."""
    from app.panels.batch import BatchPanel

    panel = BatchPanel()
    qtbot.addWidget(panel)
    st = SessionState()
    panel.refresh(st)
    assert panel.snapshot()["empty"] and panel.snapshot()["active"] == []
    st.apply(RequestStart(request_id=1, prompt_ids=[1], prompt_tokens=1))
    st.apply(RequestStart(request_id=2, prompt_ids=[1], prompt_tokens=1))
    for n in (1, 2, 3, 7, 8, 12):
        s = Step(step=n, requests=[[1, 1], [2, 5]], ms=10.0 + n)
        if n != 3:
            s.predicted_ms = 11.0 + n
        st.apply(s)
    panel.refresh(st)
    snap = panel.snapshot()
    assert not snap["empty"] and snap["steps"] == 6 and snap["predicted"] == 5 and snap["bars"] == 12
    assert snap["rows"] == {1: "1", 2: "5"} and snap["outlined"] == 6    # request 2, the newest, outlined
    assert "predicted 23.0 ms" in snap["info"] and "joint move" not in snap["info"]
    st.apply(Decision(request_id=2, round=4, action={"reuse": 1, "k": 2}, reason="argmin",
                      batch={"requests": 1, "rows": 1, "tokens": 1.0, "k_alone": 4, "joint": 2, "K": 2}))
    panel.refresh(st)
    assert "joint move of 2 requests: K = 2" in panel.snapshot()["info"]       # the batch's one K, said
    st.apply(RequestEnd(request_id=1, output_ids=[7]))
    panel.refresh(st)
    assert "joint move" not in panel.snapshot()["info"]                         # (one request left: no move)


def test_one_request_at_a_time_is_shown_as_before():
    """Sequential requests (no Step, never two open): the newest is shown, the plots keep the session's
    rounds with request boundaries, nothing counts as batched."""
    st = SessionState()
    for rid in (1, 2):
        st.apply(RequestStart(request_id=rid, prompt_ids=[1, 2, 3], prompt_tokens=3))
        st.apply(Round(request_id=rid, index=0, kind="prefill", emitted=[7], provenance=["target"]))
        st.apply(Round(request_id=rid, index=1, kind="ar", emitted=[8], provenance=["target"]))
        st.apply(RequestEnd(request_id=rid, output_ids=[7, 8]))
    assert not st.batched and st.request_id == 2 and st.active() == []
    pts, bounds, label = st.plot_rounds()
    assert [p.x for p in pts] == [1, 2] and bounds == [(0, 1), (1, 2)] and label == "round (session)"
    st.select(1)
    assert st.request_id == 1 and [t.id for t in st.tokens] == [1, 2, 3, 7, 8]


def test_records_of_a_request_first_seen_mid_way_get_a_view_of_their_own():
    """Attached after a request started: its rounds and steps still go to a view of its own."""
    st = SessionState()
    st.apply(RequestStart(request_id=5, prompt_ids=[1], prompt_tokens=1))
    st.apply(Step(step=1, requests=[[4, 1], [5, 1]], ms=2.0))
    st.apply(Round(request_id=4, index=7, kind="ar", k=2, emitted=[9], provenance=["target"]))
    st.apply(Round(request_id=5, index=0, kind="prefill", emitted=[8], provenance=["target"]))
    assert {v.request_id for v in st.active()} == {4, 5} and st.batched
    assert [t.id for t in st.views[4].tokens] == [9] and st.views[4].k == 2
    assert [t.id for t in st.views[5].tokens] == [1, 8]
    st.apply(Step(step=2, requests=[[4, "x"], [5]], ms=1.0))          # damaged rows: skipped, no crash
    assert st.n_steps == 2 and st.steps[-1].rows == []


def test_replay_of_interleaved_requests_through_the_same_panels(qtbot, win, tmp_path):
    path = tmp_path / "batch.jsonl"
    rec = Recorder(path)
    recs = interleaved(predicted=False)
    for r in recs:
        rec(r)
    rec.close()
    assert win.open_recording(str(path), play=False)
    rp = win.replayer
    third = next(i for i, r in enumerate(recs) if isinstance(r, Step)) + 1
    rp.seek(third)
    win.redraw()
    snap = win.panel_snapshot()
    assert snap["batch"]["active"] == [1, 2, 3] and snap["tokens"]["title"].startswith("Request 3 ")
    click_request(qtbot, win, 2)
    assert win.panel_snapshot()["tokens"]["title"].startswith("Request 2 ")
    with qtbot.waitSignal(win.replayFinished, timeout=T):
        rp.finish()
    win.redraw()
    snap = win.panel_snapshot()
    assert snap["batch"]["active"] == [] and snap["batch"]["shown"] == 2
    assert snap["tokens"]["title"].startswith("Request 2 ")
    views_clean(win.state)
    direct = SessionState()
    direct.apply_all(read_recording(path))
    direct.select(2)
    assert win.state.summary() == direct.summary()
    assert win.state.n_steps == direct.n_steps == 1 + max(ROUNDS.values())


# ----------------------------------------------------------------------------- the real thing
def test_replay_of_a_real_parallel_server_recording(qtbot, win, tmp_path):
    """``rakv serve --parallel 3`` in-process on a tiny model, 3 requests at once, its ``--record``
    file replayed: Steps of the three, each request's tokens its own, 3 active then 0."""
    from rakv.cli import Run
    from rakv.cli import build_parser
    from rakv.serve import Server
    from tests.tiny import save_tiny

    save_tiny(tmp_path / "target", "llama", chat=True)
    path = tmp_path / "server.jsonl"
    args = build_parser().parse_args(["serve", "--target", str(tmp_path / "target"), "--draft", "ngram",
                                      "--port", "0", "--max-new-tokens", "8", "--parallel", "3",
                                      "--policy", "ar", "--record", str(path)])
    s = Server(args, lambda on_record: Run(args, on_record=on_record)).start()
    try:
        batcher = s.service.pool.batcher
        first = threading.Event()

        for lane in s.service.pool.lanes:        # the first request waits for the other two to queue for
            def cb(r, orig=lane.callback):        # their lanes, so the three share every step until one ends
                orig(r)
                if isinstance(r, RequestStart) and not first.is_set():
                    first.set()
                    for _ in range(12_000):            # (a state to wait for, at most a minute)
                        if batcher.joining >= 2:
                            break
                        threading.Event().wait(0.005)
            lane.callback = cb

        answers = {}

        def ask(i):
            body = json.dumps({"prompt": f"request {i}: " + "a b c d " * (i + 1), "max_tokens": 8}).encode()
            req = urllib.request.Request(s.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answers[i] = json.loads(r.read())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert len(answers) == 3
    finally:
        s.close()
    recs = read_recording(path)
    steps = [r for r in recs if isinstance(r, Step)]
    assert steps and len(steps[0].requests) == 3
    assert win.open_recording(str(path), play=False)
    win.replayer.seek(recs.index(steps[0]) + 1)
    win.redraw()
    assert len(win.batch.snapshot()["active"]) == 3
    with qtbot.waitSignal(win.replayFinished, timeout=T):
        win.replayer.finish()
    win.redraw()
    snap = win.panel_snapshot()
    assert snap["batch"]["active"] == [] and snap["batch"]["steps"] == min(len(steps), 100)
    st = win.state
    ends = {r.request_id: r for r in recs if isinstance(r, RequestEnd)}
    assert set(st.views) == set(ends)
    for rid, v in st.views.items():
        assert [t.id for t in v.tokens[v.prompt_tokens:]] == ends[rid].output_ids
