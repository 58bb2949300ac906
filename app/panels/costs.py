"""Action costs: one bar per candidate (r, k) of a Decision; chosen highlighted, infeasible greyed
(reason as tooltip); after the request, the measured latency beside the prediction."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.state import SessionState

from . import make_plot

FEASIBLE = "#6baed6"
CHOSEN = "#fd8d3c"
INFEASIBLE = "#e0e0e0"
MEASURED = "#cb181d"


class CostsPanel(QWidget):
    def __init__(self):
        super().__init__()
        self.which = QComboBox()
        self.which.addItems(["per-request decision", "latest per-round re-decision"])
        self.which.setToolTip("round -1: the (r, k) decision made once per request;\n"
                              "rounds >= 1: the controller re-deciding k (cost of the remaining tokens)")
        self.which.currentIndexChanged.connect(lambda _: self._force_redraw())
        self.info = QLabel("no decision yet")
        self.info.setWordWrap(True)
        top = QHBoxLayout()
        top.addWidget(QLabel("Show"))
        top.addWidget(self.which)
        top.addStretch(1)
        self.plot = make_plot("predicted ms", "k (draft length), grouped by r")
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7)
        self.measured = pg.BarGraphItem(x=[], height=[], width=0.3, brush=MEASURED, pen=None)
        self.mtext = pg.TextItem("", color=MEASURED, anchor=(0.5, 1.0))
        self.plot.addItem(self.bars)
        self.plot.addItem(self.measured)
        self.plot.addItem(self.mtext)
        self.plot.scene().sigMouseMoved.connect(self._hover)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.info)
        lay.addWidget(self.plot, 1)
        self._key = None
        self._cands: list[dict] = []
        self._chosen = -1
        self._measured: float | None = None
        self._group_labels: list = []
        self._x = np.zeros(0)

    def _force_redraw(self) -> None:
        self._key = None
        if getattr(self, "_state", None) is not None:
            self.refresh(self._state)

    def refresh(self, state: SessionState) -> None:
        self._state = state
        per_round = self.which.currentIndex() == 1
        d = state.round_decision if per_round else state.decision
        measured = None if per_round or d is None else state.measured_ms(d.request_id)
        key = (id(d), measured)
        if key == self._key:
            return
        self._key = key
        if d is None:
            self._cands, self._chosen, self._measured = [], -1, None
            self.bars.setOpts(x=[], height=[], width=0.7, brushes=None, pens=None)
            self.measured.setOpts(x=[], height=[], width=0.34)
            self.mtext.setText("")
            self.info.setText("no decision yet" if not per_round else "no per-round re-decision in this request")
            return
        cands = sorted(d.candidates, key=lambda c: (c["reuse"], c["k"]))
        act = d.action
        chosen = next((i for i, c in enumerate(cands) if c["reuse"] == act.get("reuse") and c["k"] == act.get("k")), -1)
        # r = 0 group, a gap, then the r = 1 group; ticks show k, group labels show r
        x = np.array([i + (1.0 if c["reuse"] == 1 and any(cc["reuse"] == 0 for cc in cands) else 0.0)
                      for i, c in enumerate(cands)])
        h = np.array([max(0.0, float(c["predicted_ms"])) for c in cands])
        w = np.full(len(cands), 0.7)
        xb = x.copy()
        if measured is not None and chosen >= 0:      # split the chosen slot: prediction | measured
            xb[chosen] -= 0.18
            w[chosen] = 0.34
        brushes = [CHOSEN if i == chosen else (FEASIBLE if c.get("feasible", True) else INFEASIBLE)
                   for i, c in enumerate(cands)]
        pens = [pg.mkPen("#333", width=2) if i == chosen else pg.mkPen(None) for i in range(len(cands))]
        self.bars.setOpts(x=xb, height=h, width=w, brushes=brushes, pens=pens)
        ax = self.plot.getPlotItem().getAxis("bottom")
        ax.setTicks([[(float(xi), str(c["k"])) for xi, c in zip(x, cands)]])
        top = max([*h, measured or 0.0, 1e-3])
        for t in self._group_labels:
            self.plot.removeItem(t)
        self._group_labels = []
        for r in (0, 1):
            xs = [xi for xi, c in zip(x, cands) if c["reuse"] == r]
            if xs:
                t = pg.TextItem(f"r={r} ({'reuse' if r else 'no reuse'})", color="#555", anchor=(0.5, 0))
                t.setPos((min(xs) + max(xs)) / 2, top * 1.14)
                self.plot.addItem(t)
                self._group_labels.append(t)
        if measured is not None and chosen >= 0:
            self.measured.setOpts(x=[x[chosen] + 0.18], height=[measured], width=0.34)
            self.mtext.setText(f"measured {measured:.0f} ms")
            right = x[chosen] > (x.min() + x.max()) / 2
            self.mtext.setAnchor((1.0, 1.0) if right else (0.0, 1.0))
            self.mtext.setPos(x[chosen] + (0.35 if right else -0.35), max(measured, h[chosen]))
        else:
            self.measured.setOpts(x=[], height=[], width=0.34)
            self.mtext.setText("")
        self._x = x
        self._cands, self._chosen, self._measured = cands, chosen, measured
        pred = cands[chosen]["predicted_ms"] if chosen >= 0 else float("nan")
        where = "per-request decision" if d.round < 0 else f"round {d.round} re-decision"
        txt = (f"request {d.request_id} · {where} · chosen (r={act.get('reuse')}, k={act.get('k')}) "
               f"by {d.reason} · alpha {d.alpha:.2f} · predicted {pred:.0f} ms")
        if measured is not None:
            txt += f" · measured {measured:.0f} ms"
        n_inf = sum(1 for c in cands if not c.get("feasible", True))
        if n_inf:
            txt += f" · {n_inf} infeasible (grey)"
        self.info.setText(txt)
        self.plot.getPlotItem().setXRange(float(x.min()) - 0.6, float(x.max()) + 0.6, padding=0)
        self.plot.getPlotItem().setYRange(0, top * 1.25, padding=0)

    def _hover(self, pos) -> None:
        vb = self.plot.getPlotItem().vb
        if not self._cands or not vb.sceneBoundingRect().contains(pos):
            return
        p = vb.mapSceneToView(pos)
        tip = ""
        i = int(np.argmin(np.abs(self._x - p.x()))) if len(self._x) else -1
        if i >= 0 and abs(p.x() - self._x[i]) <= 0.35:
            c = self._cands[i]
            tip = f"r={c['reuse']}, k={c['k']}: predicted {c['predicted_ms']:.1f} ms"
            if i == self._chosen:
                tip += " (chosen)"
                if self._measured is not None:
                    tip += f"\nmeasured {self._measured:.1f} ms (RequestEnd.latency_ms)"
            if not c.get("feasible", True):
                tip += f"\ninfeasible: {c.get('reason') or 'not allowed'}"
        self.plot.setToolTip(tip)

    def tooltip_at(self, i: int) -> str:
        """The tooltip text of bar i (what hovering shows)."""
        c = self._cands[i]
        tip = f"r={c['reuse']}, k={c['k']}: predicted {c['predicted_ms']:.1f} ms"
        if not c.get("feasible", True):
            tip += f"\ninfeasible: {c.get('reason') or 'not allowed'}"
        return tip

    def snapshot(self) -> dict:
        return {"info": self.info.text(),
                "bars": [(c["reuse"], c["k"], c["predicted_ms"], c.get("feasible", True)) for c in self._cands],
                "chosen": self._chosen, "measured": self._measured}
