"""The explorer tells one story about gate copies (issue 43, item 5): in a k = 0 round the
confidence gate may still verify an n-gram copy (``Round.draft_source == "lookup"``); the token
stream, the acceptance panel, the action costs panel, the round timeline and the timing CSV count
those tokens as copies, the same number everywhere, live and in replay. Real records: the engine
on the tiny random pair, a model draft priced out (d = 5 steps a token: k = 0 on every request),
the same prompt twice, so the repeat copies its earlier output from the history."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QMessageBox  # noqa: E402

from app.settings import Settings  # noqa: E402
from app.state import COPY, DRAFT  # noqa: E402
from app.window import MainWindow  # noqa: E402
from rakv.drafts.model import ModelDraft  # noqa: E402
from rakv.records import RequestEnd, Round, request_rows  # noqa: E402
from tests.tiny import synthetic_profile  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b):"
T = 30_000


@pytest.fixture
def win(qtbot, tmp_path, pair, monkeypatch):
    monkeypatch.setattr(QMessageBox, "open", lambda self: pytest.fail(f"error dialog: {self.text()}"))
    w = MainWindow(Settings(tmp_path / "settings.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.show()
    target, draft = pair
    with qtbot.waitSignal(w.modelsLoaded, timeout=T):
        # the model draft costs 5 target steps a token: the controller picks k = 0 on every request,
        # and the gate's free n-gram lookup is the one way to gain
        w.use_models(target, ModelDraft(draft), synthetic_profile(d=5.0, alpha0=0.2))
    qtbot.waitUntil(lambda: w.live.header is not None, timeout=T)
    w.run_panel.prompt.setPlainText(PROMPT)
    w.run_panel.max_new.setValue(40)
    w.run_panel.policy.setCurrentText("adaptive:gate")
    yield w
    w.shutdown()


def run(qtbot, w) -> RequestEnd:
    with qtbot.waitSignal(w.runFinished, timeout=T) as blocker:
        w.run()
    w.redraw()
    return blocker.args[0]


def copy_story(snap: dict) -> dict:
    """The copy counts each panel shows."""
    return {"stream": snap["tokens"]["kinds"].get(COPY, 0), "stream_draft": snap["tokens"]["kinds"].get(DRAFT, 0),
            "acceptance": snap["acceptance"]["counts"]["copies_accepted"],
            "acceptance_draft": snap["acceptance"]["counts"]["accepted"]}


def test_k0_copies_are_copies_in_every_panel(qtbot, win, tmp_path):
    run(qtbot, win)
    end = run(qtbot, win)                      # the repeat: its earlier output is in the history
    rid = end.request_id
    rounds = [r for r in win.live.records if isinstance(r, Round) and r.request_id == rid and r.kind != "prefill"]
    copy_rounds = [r for r in rounds if r.draft_source == "lookup" and r.drafted]
    # the situation under test: k = 0 chosen, no model draft, and yet rounds that copied tokens
    assert end.action["k"] == 0 and end.drafted == 0 and end.accepted == 0
    assert copy_rounds and all(r.k == 0 for r in copy_rounds)
    copied = sum(p == "draft" for r in copy_rounds for p in r.provenance)
    assert copied > 0

    snap = win.panel_snapshot()
    story = copy_story(snap)
    # token stream == acceptance panel == the rounds' own records; none of it is the draft's
    assert story == {"stream": copied, "stream_draft": 0, "acceptance": copied, "acceptance_draft": 0}
    counts = snap["acceptance"]["counts"]
    assert counts["copied"] == sum(r.drafted for r in copy_rounds)
    assert counts["copy_rounds"] == counts["copy_rounds_k0"] == len(copy_rounds)
    assert counts["drafted"] == 0 and counts["rounds"] == end.rounds
    assert f"{copied} gate copies" in snap["tokens"]["title"]
    assert f"copied {copied} of {counts['copied']} verified in {len(copy_rounds)} copy round" in \
        snap["acceptance"]["counts_text"]
    # the acceptance plot marks the copy rounds (the session's: both requests') apart from drafting rounds
    session_copy_rounds = sum(1 for r in win.live.records if isinstance(r, Round) and r.draft_source == "lookup"
                              and r.drafted and r.kind != "prefill")
    assert snap["acceptance"]["copy_rounds"] == session_copy_rounds and snap["acceptance"]["draft_rounds"] == 0
    # the action says what k = 0 did: "k = 0 + copy n", in the action costs panel and the acceptance line
    assert f"chosen (r={end.action['reuse']}, k=0 + copy {copied})" in snap["costs"]["info"]
    assert f"the gate copied {copied} of {counts['copied']} verified tokens in {len(copy_rounds)} round" in \
        snap["costs"]["info"]
    assert f"chosen k=0 + copy {copied}" in snap["acceptance"]["info"]
    # ... priced as that copy: the passes it predicted beside those the request took (issue 58)
    assert "priced as the copy of its earlier output" in snap["costs"]["info"]
    assert f"target passes predicted, {end.rounds} taken" in snap["costs"]["info"]
    assert re.search(r"prediction error .*%</b> median, \d+% mean \(2 requests\)", snap["costs"]["quality"])
    assert f"{copied} of them gate copies" in snap["timeline"]["info"]
    # hovering a copied token tells the copy round, not a draft's acceptance
    st = win.live
    i = next(i for i, t in enumerate(st.tokens) if t.kind == COPY)
    tip = win.tokens.tooltip(i)
    assert tip.startswith("gate copy") and re.search(r"round \d+ \(spec, k=0\)", tip) and "gate copy round" in tip
    # the timing CSV counts the same copies, and its accept length counts them per round
    row = next(r for r in request_rows(win.live.records) if r["request_id"] == rid)
    assert (row["drafted"], row["accepted"]) == (0, 0)
    assert row["copies_accepted"] == sum(r.accepted for r in copy_rounds) >= copied
    assert row["copied"] == counts["copied"]
    assert row["mean_accept_len"] == pytest.approx(1 + row["copies_accepted"] / end.rounds, abs=1e-4)

    # a replay of the recording tells the same story
    live = win.panel_snapshot()
    assert win.open_recording(str(win.worker.recording), play=False)
    with qtbot.waitSignal(win.replayFinished, timeout=T):
        win.replay_bar.speed.setCurrentText("max")
        win.replayer.play()
    replayed = win.panel_snapshot()
    assert copy_story(replayed) == story
    assert replayed["costs"]["info"] == live["costs"]["info"]
    assert replayed["acceptance"] == live["acceptance"]
    win.leave_replay()


@pytest.mark.fast
def test_a_request_without_copies_says_plain_k(qtbot, win):
    """Without the gate (policy kv: reuse, k = 0) nothing is copied: the panels say k=0 alone."""
    win.run_panel.policy.setCurrentText("kv")
    run(qtbot, win)
    end = run(qtbot, win)
    assert not any(isinstance(r, Round) and r.draft_source == "lookup" for r in win.live.records)
    snap = win.panel_snapshot()
    assert copy_story(snap)["stream"] == copy_story(snap)["acceptance"] == 0
    assert f"k={end.action['k']})" in snap["costs"]["info"] and "+ copy" not in snap["costs"]["info"]
    assert "gate copies" not in snap["tokens"]["title"] and "copied" not in snap["acceptance"]["counts_text"]
    assert snap["acceptance"]["copy_rounds"] == 0
