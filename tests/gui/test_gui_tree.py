"""The Token tree panel (pytest-qt, offscreen): a hand-made tree round, a chain round, and a real
tree:8 run with the n-gram draft on a tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")

from PySide6.QtWidgets import QMessageBox  # noqa: E402

from app.panels.run import POLICIES  # noqa: E402
from app.panels.tree import TreePanel, label, layout  # noqa: E402
from app.settings import Settings  # noqa: E402
from app.state import SessionState  # noqa: E402
from app.window import MainWindow  # noqa: E402
from rakv.drafts.ngram import NgramDraft  # noqa: E402
from rakv.records import RequestStart, Round  # noqa: E402
from tests.tiny import make_pair  # noqa: E402

T = 60_000
REPETITIVE = "def add(a, b):\n    return a + b\n\n" * 4 + "def add(a, b):"


def _state(*rounds) -> SessionState:
    st = SessionState()
    st.apply(RequestStart(request_id=1, prompt="p", prompt_ids=[5, 6, 7], prompt_tokens=3, policy="tree:8"))
    st.apply(Round(request_id=1, index=0, kind="prefill", emitted=[9], provenance=["target"]))
    for r in rounds:
        st.apply(r)
    return st


def _tree_round() -> Round:
    # pending token 9; node 0 -> 1 -> 2 (accepted), 0 -> 3, root -> 4 -> 5
    return Round(request_id=1, index=1, kind="spec", k=6, drafted=6, accepted=3,
                 emitted=[11, 12, 13, 20], provenance=["draft", "draft", "draft", "target"],
                 tree_tokens=[11, 12, 13, 14, 15, 16], tree_parents=[-1, 0, 1, 0, -1, 4],
                 tree_path=[0, 1, 2], tree_verify="tree", tree_expected=2.5, tree_predicted_ms=12.0,
                 verify_ms=13.4)


def test_layout_depths_and_rows():
    depth, row = layout([-1, 0, 1, 0, -1, 4])
    assert depth == [1, 2, 3, 2, 1, 2]
    assert row == [0.0, 0.0, 0.0, 1.0, 2.0, 2.0]        # siblings stacked, subtrees contiguous
    assert label("\n  x") == "\u21b5\u2423\u2423x" and label("abcdefghijklmnop").endswith("\u2026")


@pytest.mark.fast
def test_panel_draws_a_hand_made_tree(qtbot):
    p = TreePanel(lambda: (lambda tid: {9: "def", 11: " add", 12: "(", 13: "a", 20: ","}.get(tid, f"<{tid}>")))
    qtbot.addWidget(p)
    p.refresh(_state(_tree_round()))
    s = p.snapshot()
    assert not s["empty"] and s["nodes"] == 6 and s["round"] == 1
    assert s["path"] == [0, 1, 2]
    assert s["accepted_items"] == 3                      # root->0, 0->1, 1->2 drawn thick
    assert s["labels"][:4] == ["def", "\u2423add", "(", "a"]   # the pending token first
    assert "6 nodes" in s["info"] and "accepted 3" in s["info"] and "verify tree" in s["info"]
    assert "expected 2.50" in s["info"] and "predicted 12.0 ms" in s["info"]
    assert len(p.nodes.data) == 7                        # root + 6 nodes
    assert not p.nodata.item.isVisible()


@pytest.mark.fast
def test_chain_round_says_no_tree(qtbot):
    p = TreePanel()
    qtbot.addWidget(p)
    chain = Round(request_id=1, index=1, kind="spec", k=4, drafted=4, accepted=2, emitted=[1, 2, 3],
                  provenance=["draft", "draft", "target"])
    p.refresh(_state(chain))
    s = p.snapshot()
    assert s["empty"] and s["nodes"] == 0 and p.nodata.item.isVisible()
    assert p.nodata.item.toPlainText() == "no tree in this round"
    assert "chain" in s["info"]
    # the tree before it stays the "latest tree"; picking the chain round shows "no tree"
    st = _state(_tree_round(), Round(request_id=1, index=2, kind="spec", k=4, emitted=[1], provenance=["target"]))
    p.refresh(st)
    assert p.snapshot()["nodes"] == 6
    p.pick.setValue(2)                                   # redraws at once
    assert p.snapshot()["empty"]
    p.pick.setValue(1)
    assert p.snapshot()["nodes"] == 6 and p.snapshot()["round"] == 1


def test_policy_chooser_offers_trees():
    assert "tree:8" in POLICIES and "adaptive:tree" in POLICIES


@pytest.fixture(scope="module")
def tree_models():
    from tests.engine.test_sampling_exact import synthetic_profile

    target, _ = make_pair("llama", "mostly")
    return target, synthetic_profile()      # a nearly flat verify: adaptive:tree keeps its trees on any machine


@pytest.fixture
def win(qtbot, tmp_path, tree_models, monkeypatch):
    monkeypatch.setattr(QMessageBox, "open", lambda self: None)
    w = MainWindow(Settings(tmp_path / "settings.ini"), tmp_path / "sessions")
    qtbot.addWidget(w)
    w.resize(1280, 720)
    w.show()
    target, profile = tree_models
    with qtbot.waitSignal(w.modelsLoaded, timeout=T):
        w.use_models(target, NgramDraft(), profile)
    qtbot.waitUntil(lambda: w.live.header is not None, timeout=T)
    yield w
    w.shutdown()


@pytest.mark.parametrize("policy", ["tree:8", "adaptive:tree"])
def test_real_tree_run_reaches_the_panel(qtbot, win, policy):
    rp = win.run_panel
    rp.prompt.setPlainText(REPETITIVE)
    rp.policy.setCurrentText(policy)
    rp.max_new.setValue(24)
    rp.raw.setChecked(True)
    for _ in range(2):      # the second run repeats the first: its earlier output is proposed as a tree
        with qtbot.waitSignal(win.runFinished, timeout=T) as blocker:
            win.run()
        end = blocker.args[0]
        assert end is not None and end.stopped != "error" and not win.errors
    trees = [r for r in win.live.records if isinstance(r, Round) and r.tree_tokens]
    assert trees and all(len(r.tree_tokens) <= (8 if policy == "tree:8" else 16) for r in trees)
    snap = win.panel_snapshot()["tree"]
    last = trees[-1]
    assert not snap["empty"] and snap["round"] == last.index and snap["nodes"] == len(last.tree_tokens)
    assert snap["path"] == list(last.tree_path) and snap["accepted_items"] == len(last.tree_path)
    assert all(not t.startswith("<") for t in snap["labels"])      # decoded by the tokenizer
    assert win.rounds_tabs.currentWidget() is win.tree and win.tree.isVisible()   # its tab came forward
    assert win.docks["timeline"].windowTitle() == "Token tree"


def test_replay_shows_the_same_tree(qtbot, win):
    """A replay draws the tree the live run drew, rejected nodes' text included (pieces file)."""
    rp = win.run_panel
    rp.prompt.setPlainText(REPETITIVE)
    rp.policy.setCurrentText("tree:8")
    rp.max_new.setValue(16)
    rp.raw.setChecked(True)
    for _ in range(2):
        with qtbot.waitSignal(win.runFinished, timeout=T):
            win.run()
    live = win.panel_snapshot()["tree"]
    assert not live["empty"]
    assert win.open_recording(str(win.worker.recording), play=False)
    win.replayer.finish()
    assert win.panel_snapshot()["tree"] == live
    win.leave_replay()
