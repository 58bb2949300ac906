"""Acceptance: alpha EWMA over rounds and requests, with the alpha* crossover lines of the latest
per-request decision (chosen k bright, others dim) and the region where speculation pays shaded.
With the confidence gate (policy adaptive:gate) a second plot shows its calibration: drafted tokens
binned by predicted acceptance, observed rate against prediction (on the diagonal = calibrated).

Rounds are marked by where their drafts came from: dots for the draft's own rounds, teal diamonds
for the gate's copy rounds (n-gram lookups it verified, in k = 0 rounds or in place of the model
draft). A count line under the info line gives the current request's drafted / accepted tokens and,
apart, its gate copies: the same numbers the token stream colours (accepted draft, gate copy)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.state import SessionState, counts_text, k_text, sampling_text

from . import PROVENANCE_COLORS, NoData, k_color, make_plot, nice_ceiling

MAX_BOUNDARIES = 60
LABEL_GAP_PX = 46          # a request boundary is labelled only this far (pixels) right of the last labelled one
NARROW = 560


class AcceptancePanel(QWidget):
    def __init__(self):
        super().__init__()
        self.info = QLabel("alpha: —")
        self.info.setWordWrap(True)
        self.info.setToolTip("blue: acceptance EWMA after each round (dots: rounds the draft drafted;\n"
                             "teal diamonds: rounds the gate verified n-gram copies, k = 0 ones included)\n"
                             "dashed: crossover alpha*(k) of the request's decision (chosen k bold)\n"
                             "green band: where speculation with the chosen k pays")
        self.counts = QLabel("")
        self.counts.setWordWrap(True)
        self.counts.setToolTip("this request's rounds: tokens the draft proposed and the target accepted (green in\n"
                               "the token stream), and apart from them the gate's n-gram copies (teal): a copy\n"
                               "round's tokens are not the draft's acceptance and leave alpha alone")
        self._counts: dict = {}
        self.plot = make_plot("alpha (EWMA)", "round (session)")
        pi = self.plot.getPlotItem()
        pi.setYRange(0, 1.05, padding=0)
        pi.setLimits(yMin=-0.05, yMax=1.1)
        self.region = pg.LinearRegionItem(values=(1, 1), orientation="horizontal", movable=False,
                                          brush=pg.mkBrush(49, 163, 84, 40), pen=pg.mkPen(None))
        self.region.setZValue(-20)
        pi.addItem(self.region)
        self.curve = pi.plot([], [], pen=pg.mkPen("#08519c", width=2), antialias=True)
        self.draft_pts = pg.ScatterPlotItem(size=5, pen=pg.mkPen(None), brush=pg.mkBrush("#08519c"), name="drafted")
        self.copy_pts = pg.ScatterPlotItem(size=9, symbol="d", pen=pg.mkPen("#1b7a5a"),
                                           brush=pg.mkBrush(PROVENANCE_COLORS["copy"]), name="gate copies")
        pi.addItem(self.draft_pts)
        pi.addItem(self.copy_pts)
        pi.disableAutoRange(axis="x")
        pi.vb.sigResized.connect(self._label_bounds)
        self.nodata = NoData(self.plot, (0.0, 10.0), (0.0, 1.05))
        self._xmax = 0.0
        self._star_lines: list[pg.InfiniteLine] = []
        self._bounds: list[pg.InfiniteLine] = []
        self._key = None
        self._stars_key = None
        self._stars: dict = {}
        self._chosen_k = None
        # the gate's reliability diagram (hidden until a gated round arrives)
        self.rel = make_plot("observed acceptance", "predicted acceptance (gate)")
        self.rel.setToolTip("drafted tokens of gated rounds, binned by the gate's predicted chance of acceptance:\n"
                            "observed rate per bin (dot size ~ tokens); dashed diagonal = perfectly calibrated")
        ri = self.rel.getPlotItem()
        ri.setXRange(0, 1, padding=0.02)
        ri.setYRange(0, 1, padding=0.02)
        ri.plot([0, 1], [0, 1], pen=pg.mkPen("#999", style=pg.QtCore.Qt.PenStyle.DashLine))
        self.rel_pts = pg.ScatterPlotItem(pen=pg.mkPen("#08519c"), brush=pg.mkBrush(8, 81, 156, 150))
        ri.addItem(self.rel_pts)
        self.rel.setMaximumWidth(260)
        self.rel.setVisible(False)
        self._narrow = False          # below NARROW px the reliability plot would squeeze the alpha plot
        self._rel_key = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.info)
        lay.addWidget(self.counts)
        row = QHBoxLayout()
        row.addWidget(self.plot, 1)
        row.addWidget(self.rel)
        lay.addLayout(row, 1)

    def refresh(self, state: SessionState) -> None:
        pts, bounds, xlabel = state.plot_rounds()
        key = (id(state), state.plot_key, len(bounds))
        if key != self._key:
            if key[0] != (self._key or (None,))[0] or key[2] != self._key[2]:
                self._draw_bounds(bounds)
            self._key = key
            self._set_xlabel(xlabel)
            x = np.array([p.x for p in pts], dtype=float)
            y = np.array([p.alpha for p in pts], dtype=float)
            self.curve.setData(x, y)
            drew = [i for i, p in enumerate(pts) if p.drafted and not p.copy_round]
            copied = [i for i, p in enumerate(pts) if p.copy_round]
            self.draft_pts.setData(x[drew], y[drew])
            self.copy_pts.setData(x[copied], y[copied])
            self.nodata.set(not len(x))
            if len(x):
                self._range(x)
            else:
                self._xmax = 0.0
        d = state.decision
        skey = (id(d),)
        if skey != self._stars_key:
            self._stars_key = skey
            self._draw_stars(d)
        if pts:
            last = pts[-1]
            txt = f"alpha EWMA {last.alpha:.3f} after round {last.index} of request {last.request_id}"
        elif d is not None:
            txt = f"alpha EWMA {d.alpha:.3f} (prior)"
        else:
            txt = "alpha: —"
        if self._chosen_k is not None:
            txt += f" · chosen {k_text(self._chosen_k, state.counts_since(1, self._chosen_k))}"
        if state.sampling:
            txt += f" · {sampling_text(state.sampling, state.verify)}"
        self._draw_gate(state)
        if state.gate_rounds:
            err = state.gate.error()
            txt += f" · gate: {state.gate_rounds} rounds, calibration error {err:.3f}" if err is not None else ""
        if self._stars:
            txt += " · α*: " + ", ".join(f"k{k} {'never' if v is None else f'{v:.2f}'}"
                                         for k, v in sorted(self._stars.items(), key=lambda kv: int(kv[0])))
        self.info.setText(txt)
        self._counts = state.counts.as_dict() if state.request_id >= 0 else {}
        ses = state.session_counts
        self.counts.setText("" if state.request_id < 0 else
                            f"request {state.request_id}: {counts_text(state.counts)}"
                            + (f" · session: {ses.accepted} accepted, {ses.copies_accepted} copied"
                               if (ses.accepted, ses.copies_accepted) != (state.counts.accepted,
                                                                          state.counts.copies_accepted) else ""))

    def _draw_gate(self, state: SessionState) -> None:
        key = (id(state), state.gate_rounds)
        if key == self._rel_key:
            return
        self._rel_key = key
        rows = state.gate.rows()
        self._has_gate = bool(rows)
        self.rel.setVisible(self._has_gate and not self._narrow)
        if rows:
            top = max(r["n"] for r in rows)
            self.rel_pts.setData([r["predicted"] for r in rows], [r["observed"] for r in rows],
                                 size=[6 + 14 * (r["n"] / top) ** 0.5 for r in rows])
        else:
            self.rel_pts.setData([], [])

    def resizeEvent(self, ev) -> None:
        """A narrow panel shows the alpha plot alone (the gate's calibration error stays in the info
        line); the reliability plot comes back when the panel is wide enough for both."""
        narrow = self.width() < NARROW
        if narrow != self._narrow:
            self._narrow = narrow
            self.rel.setVisible(getattr(self, "_has_gate", False) and not narrow)
        super().resizeEvent(ev)

    def _range(self, x) -> None:
        lo = float(x[0]) if len(x) else 0.0
        hi = float(x[-1]) if len(x) else 0.0
        want = lo + nice_ceiling(max(10.0, hi - lo + 1))
        if want != self._xmax:
            self._xmax = want
            self.plot.getPlotItem().setXRange(lo - 0.5, want, padding=0)
            self._label_bounds()

    def _draw_bounds(self, bounds: list[tuple[int, int]]) -> None:
        for ln in self._bounds:
            self.plot.removeItem(ln)
        self._bounds = []
        for x, rid in bounds[-MAX_BOUNDARIES:]:
            # the label right of its line, its bottom just above the x axis (anchors: text corner at the point)
            ln = pg.InfiniteLine(pos=x + 0.5, angle=90, pen=pg.mkPen("#bbb", style=pg.QtCore.Qt.PenStyle.DashLine),
                                 label=f"req {rid}", labelOpts={"position": 0.03, "color": "#999",
                                                                "anchors": [(0, 1), (0, 1)]})
            ln.req_text = f"req {rid}"
            self.plot.addItem(ln)
            self._bounds.append(ln)
        self._label_bounds()

    def _label_bounds(self, *_) -> None:
        """Label request boundaries no closer than LABEL_GAP_PX to the previous label (short requests
        would write "req 1req 2"); the dashed lines all stay. Again on every resize and x range step."""
        vb = self.plot.getPlotItem().vb
        (x0, x1), _ = vb.viewRange()
        px = max(float(vb.width()), 1.0) / max(x1 - x0, 1e-9)
        last = None
        for ln in self._bounds:
            x = ln.value()
            show = last is None or (x - last) * px >= LABEL_GAP_PX
            ln.label.format = ln.req_text if show else ""      # (the label re-reads its format when the line moves)
            ln.label.setText(ln.label.format)
            if show:
                last = x

    def _draw_stars(self, d) -> None:
        for ln in self._star_lines:
            self.plot.removeItem(ln)
        self._star_lines = []
        self._stars = dict(d.alpha_star) if d is not None else {}
        self._chosen_k = d.action.get("k") if d is not None else None
        finite = {int(k): v for k, v in self._stars.items() if v is not None}
        lab_k = (self._chosen_k if self._chosen_k in finite else
                 (min(finite, key=finite.get) if finite else None))
        for k, v in sorted(finite.items()):
            chosen = k == self._chosen_k or k == lab_k     # drawn strong: it bounds the shaded band
            col = QColor(k_color(k))
            col.setAlpha(255 if chosen else 90)
            # only the chosen k's line is labelled (the labels of close lines would overlap);
            # the info line lists every alpha*
            ln = pg.InfiniteLine(pos=v, angle=0, movable=False,
                                 pen=pg.mkPen(col, width=2.5 if chosen else 1, style=pg.QtCore.Qt.PenStyle.DashLine),
                                 label=f"α*(k={k}) = {v:.2f}" if k == lab_k else None,
                                 labelOpts={"position": 0.85, "color": col, "anchors": [(1, 1), (1, 1)]})
            ln.setZValue(5 if chosen else 1)
            self.plot.addItem(ln)
            self._star_lines.append(ln)
        # speculation pays above alpha* of the chosen k (or of the cheapest k when k = 0 was chosen)
        lo = None
        if self._chosen_k and self._chosen_k in finite:
            lo = finite[self._chosen_k]
        elif finite:
            lo = min(finite.values())
        self.region.setRegion((lo, 1.05) if lo is not None else (1.05, 1.05))

    def _set_xlabel(self, text: str) -> None:
        if text != getattr(self, "_xlabel", "round (session)"):
            self._xlabel = text
            self.plot.getPlotItem().setLabel("bottom", text)

    def snapshot(self) -> dict:
        x, y = self.curve.getData()
        return {"info": self.info.text(), "n": 0 if x is None else len(x),
                "last": None if y is None or not len(y) else float(y[-1]),
                "stars": {k: v for k, v in self._stars.items()}, "chosen_k": self._chosen_k,
                "region": tuple(round(v, 6) for v in self.region.getRegion()),
                "gate_bins": len(self.rel_pts.data), "empty": bool(self.nodata.empty),
                "xlabel": getattr(self, "_xlabel", "round (session)"),
                "counts": dict(self._counts), "counts_text": self.counts.text(),
                "draft_rounds": len(self.draft_pts.data), "copy_rounds": len(self.copy_pts.data),
                "bound_labels": [ln.label.toPlainText() for ln in self._bounds]}
