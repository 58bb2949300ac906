"""Round timeline: per-round time split into draft_ms (light, bottom) and verify_ms (solid, top),
coloured by k."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.state import SessionState

from . import k_color, make_plot

SHOW_ROUNDS = 240


class TimelinePanel(QWidget):
    def __init__(self):
        super().__init__()
        self.info = QLabel("no rounds yet")
        self.plot = make_plot("ms per round", "round (session)")
        pi = self.plot.getPlotItem()
        self.legend = pi.addLegend(offset=(10, 5), labelTextSize="8pt", colCount=6)
        self.draft = pg.BarGraphItem(x=[], height=[], width=0.85, pen=None)
        self.verify = pg.BarGraphItem(x=[], height=[], width=0.85, pen=None)
        pi.addItem(self.draft)
        pi.addItem(self.verify)
        self._brush: dict[tuple[int, bool], QColor] = {}
        self._legend_ks: set[int] = set()
        self._key = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.info)
        lay.addWidget(self.plot, 1)

    def _b(self, k: int, light: bool):
        b = self._brush.get((k, light))
        if b is None:
            c = QColor(k_color(k))
            if light:
                c = c.lighter(160)
            b = self._brush[(k, light)] = pg.mkBrush(c)
        return b

    def refresh(self, state: SessionState) -> None:
        key = (id(state), state.n_rounds)
        if key == self._key:
            return
        self._key = key
        pts = state.rounds[-SHOW_ROUNDS:]
        x = np.array([p.x for p in pts], dtype=float)
        dm = np.array([p.draft_ms for p in pts], dtype=float)
        vm = np.array([p.verify_ms for p in pts], dtype=float)
        self.draft.setOpts(x=x, height=dm, y0=np.zeros_like(dm), brushes=[self._b(p.k, True) for p in pts])
        self.verify.setOpts(x=x, height=vm, y0=dm, brushes=[self._b(p.k, False) for p in pts])
        for p in pts:
            if p.k not in self._legend_ks:
                self._legend_ks.add(p.k)
                self._rebuild_legend()
        if pts:
            tot_d, tot_v = float(dm.sum()), float(vm.sum())
            n_tok = sum(p.accepted + 1 for p in pts)
            self.info.setText(f"last {len(pts)} rounds: draft {tot_d:.0f} ms + verify {tot_v:.0f} ms "
                              f"for {n_tok} tokens · light = draft, solid = verify")
            self.plot.getPlotItem().setXRange(x[0] - 0.5, x[-1] + 0.5, padding=0.02)
        else:
            self.info.setText("no rounds yet")

    def _rebuild_legend(self) -> None:
        self.legend.clear()
        for k in sorted(self._legend_ks):
            item = pg.BarGraphItem(x=[], height=[], width=1, brush=self._b(k, False), pen=None)
            self.legend.addItem(item, f"k={k}")

    def snapshot(self) -> dict:
        o = self.verify.opts
        return {"info": self.info.text(), "n": len(o.get("x", [])),
                "verify": [float(v) for v in (o.get("height") if o.get("height") is not None else [])]}
