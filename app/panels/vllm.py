"""vLLM server: a watched vLLM deployment's speculation and prefix cache, from its /metrics.

Three plots: acceptance per draft position (bars: vLLM's own rate, drafts whose position j was
accepted over drafts; dots: the conditional rate given j - 1 was), alpha per token per poll
interval against the crossover alpha*(k) lines of a vLLM cost profile (the server's k bold, the
band where it pays shaded, as in the Acceptance panel), and the prefix-cache hit rate per poll
interval. Lines above: the counters since the server started, and the profile's measured costs.
``refresh()`` draws the state it was given (``show_state``) when its version changed.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from . import NoData, k_color, make_plot


def _n(v: float) -> str:
    return f"{v:,.0f}"


def _p(v) -> str:
    return "—" if v is None else f"{v:.3f}"


class VllmPanel(QWidget):
    profileRequested = Signal()
    detachRequested = Signal()

    def __init__(self):
        super().__init__()
        self.state = None
        self._key = None
        self.info = QLabel("not watching a vLLM server (File → Watch a vLLM server ...)")
        self.info.setWordWrap(True)
        self.counts = QLabel("")
        self.counts.setWordWrap(True)
        self.counts.setToolTip("since the server started (its counters): drafts, accepted of drafted tokens, alpha per "
                               "token (pooled over positions), prefix-cache hits of queried tokens, generated "
                               "tokens, finished requests, vLLM's measured inter-token latency")
        self.costs = QLabel("no cost profile: Cost profile ... picks one made by `rakv calibrate --engine vllm`")
        self.costs.setWordWrap(True)
        self.profile_btn = QPushButton("Cost profile ...")
        self.profile_btn.setToolTip("a vLLM cost profile (rakv calibrate --engine vllm) for the crossover alpha*(k)")
        self.profile_btn.clicked.connect(self.profileRequested)
        self.detach_btn = QPushButton("Detach")
        self.detach_btn.setToolTip("stop polling the vLLM server (the last numbers stay)")
        self.detach_btn.clicked.connect(self.detachRequested)
        # acceptance per position
        self.pos_plot = make_plot("acceptance", "draft position")
        self.pos_plot.setToolTip("bars: vLLM's per-position acceptance rate (drafts whose position j was accepted, "
                                 "over drafts)\ndots: the conditional rate, given position j - 1 was accepted")
        pi = self.pos_plot.getPlotItem()
        pi.setYRange(0, 1.05, padding=0)
        self.pos_bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush="#a1d99b", pen=None)
        self.cond_pts = pg.ScatterPlotItem(size=8, pen=pg.mkPen("#08519c"), brush=pg.mkBrush("#08519c"))
        pi.addItem(self.pos_bars)
        pi.addItem(self.cond_pts)
        self.pos_nodata = NoData(self.pos_plot, (-0.6, 3.6), (0.0, 1.05))
        # alpha over time, with the crossover
        self.alpha_plot = make_plot("alpha per token", "seconds (watch)")
        self.alpha_plot.setToolTip("blue: alpha per token in each poll interval (pooled over positions)\n"
                                   "grey: since the server started\ndashed: the profile's crossover alpha*(k) "
                                   "(the server's k bold); green band: where that k pays")
        ai = self.alpha_plot.getPlotItem()
        ai.setYRange(0, 1.05, padding=0)
        self.region = pg.LinearRegionItem(values=(1.05, 1.05), orientation="horizontal", movable=False,
                                          brush=pg.mkBrush(49, 163, 84, 40), pen=pg.mkPen(None))
        self.region.setZValue(-20)
        ai.addItem(self.region)
        self.alpha_curve = ai.plot([], [], pen=pg.mkPen("#08519c", width=2), symbol="o", symbolSize=4,
                                   symbolBrush="#08519c", symbolPen=None)
        self.alpha_total = ai.plot([], [], pen=pg.mkPen("#999", width=1, style=pg.QtCore.Qt.PenStyle.DashLine))
        self.alpha_nodata = NoData(self.alpha_plot, (0.0, 10.0), (0.0, 1.05))
        self._star_lines: list = []
        self._stars_key = None
        # prefix-cache hit rate over time
        self.hit_plot = make_plot("prefix-cache hit rate", "seconds (watch)")
        self.hit_plot.setToolTip("prefix-cache hits over queries (tokens) in each poll interval with queries")
        hi = self.hit_plot.getPlotItem()
        hi.setYRange(0, 1.05, padding=0)
        self.hit_curve = hi.plot([], [], pen=pg.mkPen("#6baed6", width=2), symbol="o", symbolSize=4,
                                 symbolBrush="#3182bd", symbolPen=None)
        self.hit_nodata = NoData(self.hit_plot, (0.0, 10.0), (0.0, 1.05))
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        top = QHBoxLayout()
        top.addWidget(self.info, 1)
        top.addWidget(self.profile_btn)
        top.addWidget(self.detach_btn)
        lay.addLayout(top)
        lay.addWidget(self.counts)
        lay.addWidget(self.costs)
        row = QHBoxLayout()
        row.addWidget(self.pos_plot, 2)
        row.addWidget(self.alpha_plot, 3)
        row.addWidget(self.hit_plot, 3)
        lay.addLayout(row, 1)
        for pl in (self.pos_plot, self.alpha_plot, self.hit_plot):
            pl.setMinimumHeight(120)
        self._snap: dict = {}

    def show_state(self, state) -> None:
        self.state = state
        self._key = None
        self.refresh()

    # ------------------------------------------------------------------ drawing
    def refresh(self, *_) -> None:
        st = self.state
        if st is None:
            return
        key = (id(st), st.version)
        if key == self._key:
            return
        self._key = key
        rec = st.latest
        tot = rec.total if rec is not None else None
        self.info.setText(st.status.replace("/metrics", "") + (f" · poll {rec.poll}" if rec is not None else "")
                          + (f" · {rec.restarts} restart{'s' if rec.restarts != 1 else ''} seen"
                             if rec is not None and rec.restarts else ""))
        self.info.setStyleSheet("color: #b30000;" if st.down else "")
        if tot is None:
            self.counts.setText("")
        else:
            if tot.speculating:
                spec = (f"<b>k = {tot.k}</b>: {_n(tot.drafts)} drafts, {_n(tot.accepted)} accepted of "
                        f"{_n(tot.draft_tokens)} drafted ({_p(tot.draft_acceptance)}) · <b>alpha per token "
                        f"{_p(tot.alpha)}</b> · {_p(tot.mean_accepted)} accepted per draft")
            else:
                spec = "no speculation configured (no spec_decode metrics)"
            cache = (f"<b>prefix-cache hit rate {_p(tot.hit_rate)}</b> ({_n(tot.prefix_hits)} of "
                     f"{_n(tot.prefix_queries)} tokens; {_n(tot.prompt_cached)} prompt tokens cached) · "
                     f"{_n(tot.generation_tokens)} generated, {_n(tot.requests)} requests"
                     + (f" · {tot.itl_ms:.1f} ms between tokens" if tot.itl_ms is not None else ""))
            self.counts.setText(spec + "<br>" + cache)
        self._draw_positions(tot)
        self._draw_series(st)
        self._draw_costs(st, tot)

    def _draw_positions(self, tot) -> None:
        if tot is None or not tot.per_pos or tot.drafts <= 0:
            self.pos_bars.setOpts(x=[], height=[])
            self.cond_pts.setData([], [])
            self.pos_nodata.set(True)
            return
        x = np.arange(len(tot.per_pos), dtype=float)
        self.pos_bars.setOpts(x=x, height=[v or 0.0 for v in tot.per_position], width=0.6)
        cond = [(i, v) for i, v in enumerate(tot.conditional) if v is not None]
        self.cond_pts.setData([c[0] for c in cond], [c[1] for c in cond])
        self.pos_plot.getPlotItem().setXRange(-0.6, len(x) - 0.4, padding=0)
        self.pos_nodata.set(False)

    def _draw_series(self, st) -> None:
        recs = st.records
        pts = [(r.t, r.delta.alpha) for r in recs if r.delta is not None and r.delta.alpha is not None]
        tot = [(r.t, r.total.alpha) for r in recs if r.total.alpha is not None]
        hits = [(r.t, r.delta.hit_rate) for r in recs if r.delta is not None and r.delta.hit_rate is not None]
        self.alpha_curve.setData([p[0] for p in pts], [p[1] for p in pts])
        self.alpha_total.setData([p[0] for p in tot], [p[1] for p in tot])
        self.hit_curve.setData([p[0] for p in hits], [p[1] for p in hits])
        self.alpha_nodata.set(not pts and not tot)
        self.hit_nodata.set(not hits)
        if recs:
            lo, hi = recs[0].t, recs[-1].t
            for pl in (self.alpha_plot, self.hit_plot):
                pl.getPlotItem().setXRange(lo, max(hi, lo + 10.0), padding=0.02)
        self._snap = {"alpha_series": [round(p[1], 4) for p in pts], "hit_series": [round(p[1], 4) for p in hits],
                      "alpha_total_series": [round(p[1], 4) for p in tot]}

    def _draw_costs(self, st, tot) -> None:
        cx = st.crossover
        k = tot.k if tot is not None else 0
        skey = (id(cx), k)
        if skey != self._stars_key:
            self._stars_key = skey
            for ln in self._star_lines:
                self.alpha_plot.removeItem(ln)
            self._star_lines = []
            lo = None
            if cx is not None:
                ks = [int(x) for x in cx.alpha_star if (not k or int(x) <= k)]
                for kk in sorted(ks):
                    v = cx.alpha_star[str(kk)]
                    if v is None:
                        continue
                    mine = kk == k
                    col = QColor(k_color(kk))
                    col.setAlpha(255 if mine else 90)
                    ln = pg.InfiniteLine(pos=v, angle=0, movable=False,
                                         pen=pg.mkPen(col, width=2.5 if mine else 1,
                                                      style=pg.QtCore.Qt.PenStyle.DashLine),
                                         label=f"α*(k={kk}) = {v:.2f}" if mine else None,
                                         labelOpts={"position": 0.85, "color": col, "anchors": [(1, 1), (1, 1)]})
                    ln.setZValue(5 if mine else 1)
                    self.alpha_plot.addItem(ln)
                    self._star_lines.append(ln)
                    if mine:
                        lo = v
            self.region.setRegion((lo, 1.05) if lo is not None else (1.05, 1.05))
        if cx is None:
            self.costs.setText("no cost profile: Cost profile ... picks one made by `rakv calibrate --engine vllm`")
            return
        shown = sorted(int(x) for x in cx.V_ms if int(x) in cx.measured_ks or int(x) == k)
        txt = (f"profile {cx.path.rsplit('/', 1)[-1]}: t = {cx.t_ms:g} ms, "
               + ", ".join(f"V({x}) = {cx.V_ms[x]:g}" for x in shown)
               + " · α* " + ", ".join(f"k{x} {'never' if cx.alpha_star[str(x)] is None else f'{cx.alpha_star[str(x)]:.2f}'}"
                                      for x in shown))
        star = cx.star(k) if k else None
        if tot is not None and tot.alpha is not None and k:
            if star is None:
                verdict = f"k = {k} never pays on this profile"
            elif tot.alpha >= star:
                verdict = f"alpha {tot.alpha:.3f} ≥ α*({k}) = {star:.3f}: k = {k} pays"
            else:
                verdict = f"alpha {tot.alpha:.3f} < α*({k}) = {star:.3f}: k = {k} costs more than plain steps"
            txt += " · " + verdict
        self.costs.setText(txt)

    def snapshot(self) -> dict:
        st = self.state
        rec = st.latest if st is not None else None
        tot = rec.total if rec is not None else None
        cx = st.crossover if st is not None else None
        return {"info": self.info.text(), "counts": self.counts.text(), "costs": self.costs.text(),
                "per_position": list(tot.per_position) if tot is not None else [],
                "conditional": list(tot.conditional) if tot is not None else [],
                "bars": [float(h) for h in (self.pos_bars.opts.get("height") or [])],
                "alpha": tot.alpha if tot is not None else None,
                "hit_rate": tot.hit_rate if tot is not None else None,
                "k": tot.k if tot is not None else 0,
                "stars": dict(cx.alpha_star) if cx is not None else {},
                "star_lines": [round(ln.value(), 4) for ln in self._star_lines],
                "region": tuple(round(v, 4) for v in self.region.getRegion()),
                "polls": rec.poll if rec is not None else 0, "restarts": rec.restarts if rec is not None else 0,
                "points": len(st.records) if st is not None else 0, **self._snap}
