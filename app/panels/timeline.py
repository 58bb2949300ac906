"""Round timeline: per-round time split into draft_ms (light, bottom) and verify_ms (solid, top),
coloured by k."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app.state import SessionState

from . import NoData, k_color, make_plot, nice_ceiling

SHOW_ROUNDS = 240


class TimelinePanel(QWidget):
    def __init__(self):
        super().__init__()
        self.info = QLabel("no rounds yet")
        self.info.setWordWrap(True)
        self.plot = make_plot("ms per round", "round (session)")
        pi = self.plot.getPlotItem()
        self.legend = pi.addLegend(offset=(10, 5), labelTextSize="8pt", colCount=3)
        # one pair of bar items per k (a single brush each: pyqtgraph's fast path)
        self.items: dict[int, tuple[pg.BarGraphItem, pg.BarGraphItem]] = {}
        self._verify_heights: list[float] = []
        self._brush: dict[tuple[int, bool], QColor] = {}
        self._legend_ks: set[int] = set()
        self._key = None
        self._ranges = None
        pi.disableAutoRange()
        self.nodata = NoData(self.plot, (0.0, 10.0), (0.0, 10.0))
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
        key = (id(state), state.plot_key)
        if key == self._key:
            return
        self._key = key
        pts, _, xlabel = state.plot_rounds()
        pts = pts[-SHOW_ROUNDS:]
        self._set_xlabel(xlabel)
        x = np.array([p.x for p in pts], dtype=float)
        dm = np.array([p.draft_ms for p in pts], dtype=float)
        vm = np.array([p.verify_ms for p in pts], dtype=float)
        ks = np.array([p.k for p in pts], dtype=int)
        for k in sorted(set(ks.tolist()) | set(self.items)):
            if k not in self.items:
                d = pg.BarGraphItem(x=[], height=[], width=0.85, pen=None, brush=self._b(k, True))
                v = pg.BarGraphItem(x=[], height=[], width=0.85, pen=None, brush=self._b(k, False))
                self.plot.addItem(d)
                self.plot.addItem(v)
                self.items[k] = (d, v)
            m = ks == k
            d, v = self.items[k]
            d.setOpts(x=x[m], height=dm[m], y0=np.zeros(int(m.sum())))
            v.setOpts(x=x[m], height=vm[m], y0=dm[m])
        self._verify_heights = [float(h) for h in vm]
        if set(ks.tolist()) - self._legend_ks:
            self._legend_ks |= set(ks.tolist())
            self._rebuild_legend()
        if pts:
            tot_d, tot_v = float(dm.sum()), float(vm.sum())
            n_tok = sum(p.accepted + 1 for p in pts)
            n_copy = sum(p.copied for p in pts)
            n_copy_rounds = sum(1 for p in pts if p.copy_round)
            copies = (f", {n_copy} of them gate copies in {n_copy_rounds} copy round"
                      f"{'s' if n_copy_rounds != 1 else ''}" if n_copy_rounds else "")
            self.info.setText(f"last {len(pts)} rounds: draft {tot_d:.0f} ms + verify {tot_v:.0f} ms "
                              f"for {n_tok} tokens{copies} · light = draft, solid = verify")
            self.nodata.set(False)
            self._range(float(x[0]), float(x[-1]), float((dm + vm).max()))
        else:
            self.info.setText("no rounds yet")
            self._ranges = None
            self.nodata.set(True)

    def _range(self, lo: float, hi: float, ymax: float) -> None:
        """Stepped ranges: the axes change only when the data outgrows them."""
        xr = (lo - 0.5, lo + nice_ceiling(max(10.0, hi - lo + 1)))
        yr = (0.0, nice_ceiling(ymax * 1.25))     # headroom for the legend
        if (xr, yr) != self._ranges:
            self._ranges = (xr, yr)
            pi = self.plot.getPlotItem()
            pi.setXRange(*xr, padding=0)
            pi.setYRange(*yr, padding=0)

    def _rebuild_legend(self) -> None:
        self.legend.clear()
        for k in sorted(self._legend_ks):
            item = pg.BarGraphItem(x=[], height=[], width=1, brush=self._b(k, False), pen=None)
            self.legend.addItem(item, f"k={k}")

    def _set_xlabel(self, text: str) -> None:
        if text != getattr(self, "_xlabel", "round (session)"):
            self._xlabel = text
            self.plot.getPlotItem().setLabel("bottom", text)

    def snapshot(self) -> dict:
        return {"info": self.info.text(), "n": len(self._verify_heights), "verify": list(self._verify_heights),
                "empty": bool(self.nodata.empty), "xlabel": getattr(self, "_xlabel", "round (session)")}
