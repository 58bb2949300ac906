"""Token tree: the tree a round verified (policy ``tree:N`` / ``adaptive:tree``), drawn left to
right by depth, siblings stacked, the accepted path highlighted and the rejected nodes dimmed."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSpinBox, QVBoxLayout, QWidget

from app.state import SessionState
from rakv.records import Round

from . import NoData, make_plot

ACCEPTED = "#31a354"       # accepted path: nodes and edges
ROOT = "#fee391"           # the pending token (the target's token, as in the token stream)
REJECTED = "#d0d0d0"       # nodes the verify did not accept
EDGE_DIM = "#c8c8c8"
LABEL_CHARS = 10


def label(text: str, n: int = LABEL_CHARS) -> str:
    """A token's text for a node: whitespace and control characters visible, at most n chars."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\u21b5")
        elif ch == "\t":
            out.append("\u21e5")
        elif ch == " ":
            out.append("\u2423")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    s = "".join(out) or "\u2205"
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def layout(parents: list[int]) -> tuple[list[int], list[float]]:
    """(depth, row) per node; index -1 of the lists' conceptual root is the pending token at
    depth 0, row of its children's centre. Children keep their order (heaviest first), each
    subtree takes contiguous rows, a parent sits at its first child's row."""
    n = len(parents)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        p = p if 0 <= p < i else -1        # a malformed parent hangs off the root
        kids.setdefault(p, []).append(i)
    depth = [0] * n
    row = [0.0] * n
    nxt = [0]

    def place(node: int, d: int) -> float:
        ch = kids.get(node, [])
        if node >= 0:
            depth[node] = d
        if not ch:
            r = float(nxt[0])
            nxt[0] += 1
        else:
            rows = [place(c, d + 1) for c in ch]
            r = rows[0]
        if node >= 0:
            row[node] = r
        return r

    place(-1, 0)
    return depth, row


class TreePanel(QWidget):
    def __init__(self, pieces=None):
        super().__init__()
        # () -> the token stream's current Pieces (id -> text; live tokenizer or a replay's table)
        self.pieces = pieces or (lambda: (lambda tid: f"<{tid}>"))
        self.info = QLabel("no tree yet")
        self.info.setWordWrap(True)
        self.pick = QSpinBox()
        self.pick.setRange(0, 100000)
        self.pick.setSpecialValueText("latest tree")
        self.pick.setPrefix("round ")
        self.pick.setToolTip("the round of the current request to show (latest tree: the last round that "
                             "verified a tree)")
        self.pick.valueChanged.connect(lambda _: self._invalidate())
        self.plot = make_plot("", "")
        pi = self.plot.getPlotItem()
        for ax in ("left", "bottom"):
            pi.hideAxis(ax)
        pi.showGrid(x=False, y=False)
        pi.setMouseEnabled(x=False, y=False)
        pi.hideButtons()
        pi.disableAutoRange()
        self.plot.setMinimumHeight(120)
        self.edges_dim = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen(EDGE_DIM, width=1))
        self.edges_hit = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen(ACCEPTED, width=3.5))
        self.nodes = pg.ScatterPlotItem([], [], size=11, pxMode=True)
        for it in (self.edges_dim, self.edges_hit, self.nodes):
            pi.addItem(it)
        self.labels: list[pg.TextItem] = []
        self.nodata = NoData(self.plot, (0.0, 10.0), (0.0, 1.0), "no tree in this round")
        self._key = None
        self._state: SessionState | None = None
        self._snap: dict = {"round": None, "nodes": 0, "path": [], "accepted_items": 0, "labels": [],
                            "empty": True, "info": self.info.text()}
        top = QHBoxLayout()
        top.addWidget(self.info, 1)
        top.addWidget(self.pick)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.plot, 1)

    def _invalidate(self) -> None:
        """A new pick redraws at once (the window redraws panels only when the state changed)."""
        self._key = None
        if self._state is not None:
            self.refresh(self._state)

    def _piece(self, tid: int) -> str:
        try:
            return self.pieces()(int(tid))
        except Exception:  # noqa: BLE001
            return f"<{tid}>"

    @staticmethod
    def pick_round(state: SessionState, index: int = 0) -> tuple[Round | None, Round | None]:
        """(the round to show, the latest round): a chosen round index, else the current
        request's latest round with a tree."""
        rounds = state.rounds_by_index
        latest = rounds[max(rounds)] if rounds else None
        if index > 0:
            return rounds.get(index), latest
        for i in sorted(rounds, reverse=True):
            if rounds[i].tree_tokens:
                return rounds[i], latest
        return None, latest

    def refresh(self, state: SessionState) -> None:
        self._state = state
        r, latest = self.pick_round(state, self.pick.value())
        key = (id(state), state.request_id, id(r), id(latest) if r is None else 0, self.pick.value())
        if key == self._key:
            return
        self._key = key
        if r is None or not r.tree_tokens:
            shown = r if r is not None else latest
            if shown is None:
                what = "no rounds yet" if state.request_id < 0 else f"request {state.request_id}: no rounds yet"
            else:
                what = (f"request {state.request_id}, round {shown.index} ({shown.kind}, k = {shown.k}): "
                        "a chain or plain step; trees come from tree:N and adaptive:tree")
            self._clear(what)
            return
        self._draw(state, r)

    def _clear(self, what: str) -> None:
        self.info.setText(what)
        for it in (self.edges_dim, self.edges_hit):
            it.setData([], [])
        self.nodes.setData([], [])
        for t in self.labels:
            t.setVisible(False)
        self.nodata.set(True, "no tree in this round")
        self._snap = {"round": None, "nodes": 0, "path": [], "accepted_items": 0, "labels": [], "empty": True,
                      "info": what}

    def _root_token(self, state: SessionState, r: Round) -> int | None:
        """The pending token the tree hangs off: the last token emitted before this round."""
        for t in reversed(state.tokens):
            if 0 <= t.round < r.index:
                return t.id
        return None

    def _draw(self, state: SessionState, r: Round) -> None:
        toks, parents = list(r.tree_tokens), list(r.tree_parents)
        parents = (parents + [-1] * len(toks))[: len(toks)]
        n = len(toks)
        path = [i for i in r.tree_path if 0 <= i < n]
        on_path = set(path)
        depth, row = layout(parents)
        root_row = next((row[i] for i, p in enumerate(parents) if not 0 <= p < i), 0.0)
        xs = np.array([0.0] + [float(d) for d in depth])
        ys = -np.array([root_row] + row)                   # rows downwards
        # edges
        dim, hit = [], []
        for i, p in enumerate(parents):
            a = 0 if not (0 <= p < i) else p + 1
            seg = [(xs[a], ys[a]), (xs[i + 1], ys[i + 1])]
            (hit if i in on_path and (a == 0 or p in on_path) else dim).extend(seg)
        for item, seg in ((self.edges_dim, dim), (self.edges_hit, hit)):
            if seg:
                a = np.array(seg)
                item.setData(a[:, 0], a[:, 1])
            else:
                item.setData([], [])
        brushes = [pg.mkBrush(ROOT)] + [pg.mkBrush(ACCEPTED if i in on_path else REJECTED) for i in range(n)]
        pens = [pg.mkPen("#333", width=1.5)] + [pg.mkPen("#1b5e20" if i in on_path else "#aaaaaa",
                                                         width=2 if i in on_path else 1) for i in range(n)]
        sizes = [13] + [13 if i in on_path else 10 for i in range(n)]
        self.nodes.setData(xs, ys, brush=brushes, pen=pens, size=sizes)
        # labels (right of each node; the pending token's too)
        root_id = self._root_token(state, r)
        D = max(depth) if depth else 0
        R = max(row) if row else 0
        col_px = max(1, self.plot.width()) / (D + 1.2)       # labels fit their column (~7 px a char)
        chars = max(3, min(LABEL_CHARS, int(col_px / 7) - 1))
        texts = [label(self._piece(root_id), chars) if root_id is not None else "pending"] + \
                [label(self._piece(t), chars) for t in toks]
        pi = self.plot.getPlotItem()
        while len(self.labels) < len(texts):
            t = pg.TextItem("", anchor=(0, 1.0))
            pi.addItem(t, ignoreBounds=True)
            self.labels.append(t)
        for j, t in enumerate(self.labels):
            if j >= len(texts):
                t.setVisible(False)
                continue
            acc = j == 0 or (j - 1) in on_path
            t.setColor("#111" if acc else "#9a9a9a")
            t.setText(texts[j])
            t.setPos(xs[j] + 0.06, ys[j] + 0.08)
            t.setVisible(True)
        self.nodata.set(False)
        pi.setXRange(-0.25, D + 0.95, padding=0)
        pi.setYRange(-(R + 0.6), 0.75, padding=0)
        bits = [f"request {state.request_id}, round {r.index}: {n} node{'s' if n != 1 else ''}",
                f"accepted {len(path)} (+1 target token)", f"verify {r.tree_verify or '?'}"]
        if r.tree_expected is not None:
            bits.append(f"expected {r.tree_expected:.2f} tokens")
        if r.tree_predicted_ms is not None:
            bits.append(f"predicted {r.tree_predicted_ms:.1f} ms")
        bits.append(f"measured {r.verify_ms:.1f} ms")
        info = " · ".join(bits)
        self.info.setText(info)
        self._snap = {"round": r.index, "nodes": n, "path": path, "accepted_items": len(hit) // 2,
                      "labels": texts, "empty": False, "info": info}

    def snapshot(self) -> dict:
        return dict(self._snap, info=self.info.text(), empty=bool(self.nodata.empty))
