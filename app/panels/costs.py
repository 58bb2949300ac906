"""Action costs: one bar per candidate (r, k) of a Decision; chosen highlighted, infeasible greyed
(reason as tooltip); after the request, the measured latency beside the prediction. A chosen k = 0
whose rounds the confidence gate filled with n-gram copies says so: "k=0 + copy n" (n copied tokens
the target accepted), as the token stream and the acceptance panel count them; an exact repeat
priced as the copy of its earlier output says so, and the target passes predicted beside those taken.

Third view, "measured: every action" (an ``OracleResult``): every action's predicted bar with its
measured median beside it (whisker: fastest to slowest run), the oracle (best measured feasible
action) in green with a star, and the regret of the controller's choice stated above the plot. It
comes up by itself when a measurement arrives and goes back to the per-request view when the next
request starts."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.state import SessionState, k_text

from . import NoData, make_plot

FEASIBLE = "#6baed6"
CHOSEN = "#fd8d3c"
INFEASIBLE = "#e0e0e0"
MEASURED = "#cb181d"
ORACLE = "#238b45"
VIEW_REQUEST, VIEW_ROUND, VIEW_ORACLE, VIEW_REQUESTS = 0, 1, 2, 3
MAX_REQUESTS_SHOWN = 24        # the "every request" view: the latest ones
GOOD_ERROR = 0.25              # a prediction within this of the measured latency counts as good


def quality_text(state: SessionState) -> tuple[str, str]:
    """The cost profile's quality line (rich text) and its tooltip: contended or clean (from the run
    header's ``profile``), the largest per-term spread, and the prediction error so far (predicted vs
    measured latency of every finished request)."""
    h = state.header
    p = (getattr(h, "profile", None) or {}) if h is not None else {}
    parts, tip = [], []
    if not p:
        parts.append("profile: " + ("not in this recording" if h is not None else "—"))
    else:
        if p.get("contended"):
            parts.append(f"profile <b style='color:{MEASURED}'>contended</b>")
        else:
            parts.append(f"profile <span style='color:{ORACLE}'>clean</span>")
        spread = p.get("spread") or {}
        if spread:
            term, worst = max(spread.items(), key=lambda kv: kv[1])
            parts.append(f"spread ≤ {worst * 100:.0f}%")
            tip.append(f"largest spread between the repeats of a term: {worst * 100:.0f}% ({term})")
        tip.append(f"calibrated {p.get('calibrated_at') or '?'} in {p.get('calibration_s', 0):.0f} s; CPU share "
                   f"{p.get('cpu_share', '?')}; {p.get('retries', 0)} terms re-measured")
        for r in p.get("reasons") or []:
            tip.append(f"contended: {r}")
        if spread:
            tip.append("spread of the repeats per term: " + ", ".join(
                f"{k} {v * 100:.0f}%" for k, v in sorted(spread.items(), key=lambda kv: -kv[1])))
    fixes = corrections_of(state)
    if fixes:
        parts.append("corrected by rounds: " + ", ".join(f"{t} x{c:.2f}" for t, c in fixes.items()))
        tip.append("the round records disagreed with the calibrated V(k) by more than its noise, so the learned "
                   "scale corrects it (CostProfile.shape_correction): " + ", ".join(
                       f"{t} x{c:.2f}" for t, c in fixes.items()))
    rows = state.prediction_errors()
    mape = state.prediction_mape()
    if mape is not None:
        med = state.prediction_median()
        col = ORACLE if med <= GOOD_ERROR else ("#d94801" if med <= 2 * GOOD_ERROR else MEASURED)
        _, pr, me = rows[-1]
        parts.append(f"prediction error <b style='color:{col}'>{med * 100:.0f}%</b> median, {mape * 100:.0f}% mean "
                     f"({len(rows)} request{'s' if len(rows) != 1 else ''})")
        tip.append(f"prediction error: median and mean of |predicted - measured| / measured over {len(rows)} "
                   f"finished requests (RequestEnd.predicted_ms vs latency_ms; green: median within "
                   f"{GOOD_ERROR * 100:.0f}%); the last: predicted {pr:.0f} ms, measured {me:.0f} ms "
                   f"(Show: predicted vs measured: every request)")
    else:
        parts.append("prediction error: —")
        tip.append("prediction error: none yet (no finished request with a prediction)")
    moved = getattr(state.decision, "cost_scales", None) or {}
    if moved:
        parts.append("corrected online: " + ", ".join(f"{k} ×{v:.2f}" for k, v in moved.items()))
        tip.append("the round records disagreed with the profile: these online cost scales (measured / "
                   "calibrated) now correct its terms by more than 10% (machine: every term together)")
    if p and (p.get("contended") or (mape is not None and mape > GOOD_ERROR and len(rows) >= 3)):
        parts.append("<i>Run → Recalibrate costs</i>")
    return "<b>Costs</b>: " + " · ".join(parts), "\n".join(tip)


def corrections_of(state: SessionState) -> dict:
    """The V(k) corrections in force after the latest finished request ({} before one, or in a
    recording made before they were recorded)."""
    end = getattr(state, "last_end", None)
    return dict(getattr(end, "cost_corrections", None) or {})


def passes_text(d, measured: int | None) -> str:
    """The chosen action's predicted target passes after the prefill, and those the request took."""
    pp = getattr(d, "predicted_passes", None)
    if pp is None:
        return ""
    return f" · {pp:.0f} target passes predicted" + ("" if measured is None else f", {measured} taken")


class CostsPanel(QWidget):
    def __init__(self):
        super().__init__()
        self.which = QComboBox()
        self.which.addItems(["per-request decision", "latest per-round re-decision", "measured: every action",
                             "predicted vs measured: every request"])
        self.which.setToolTip("round -1: the (r, k) decision made once per request;\n"
                              "rounds >= 1: the controller re-deciding k (cost of the remaining tokens);\n"
                              "measured: every action run on one prompt from the same state (Measure every action);\n"
                              "every request: the chosen action's predicted cost beside the measured latency")
        self.which.currentIndexChanged.connect(self._view_changed)
        self.info = QLabel("no decision yet")
        self.info.setWordWrap(True)
        self.quality = QLabel("")
        self.quality.setWordWrap(True)
        self.quality.setTextFormat(Qt.TextFormat.RichText)
        self._quality_key = None
        self.regret = QLabel("")
        self.regret.setWordWrap(True)
        self.regret.setTextFormat(Qt.TextFormat.RichText)
        self.regret.hide()
        # as narrow as a short entry needs (a narrow window gives way here, not in the left dock), wider
        # where there is room
        self.which.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.which.setMinimumContentsLength(12)
        top = QHBoxLayout()
        top.addWidget(QLabel("Show"))
        top.addWidget(self.which, 1)
        self.plot = make_plot("predicted ms", "k (draft length), grouped by r")
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7)
        self.measured = pg.BarGraphItem(x=[], height=[], width=0.3, brush=MEASURED, pen=None)
        self.mtext = pg.TextItem("", color=MEASURED, anchor=(0.5, 0.0))    # its top edge at its position
        self.plot.addItem(self.bars)
        self.plot.addItem(self.measured)
        self.plot.addItem(self.mtext)
        self.pred_bars = pg.BarGraphItem(x=[], height=[], width=0.34)        # oracle view
        self.meas_bars = pg.BarGraphItem(x=[], height=[], width=0.34)
        self.whiskers = pg.ErrorBarItem(x=np.zeros(0), y=np.zeros(0), pen=pg.mkPen("#222", width=1.5), beam=0.14)
        self.star = pg.ScatterPlotItem(symbol="star", size=16, brush=ORACLE, pen=pg.mkPen("#111"))
        self.otext = pg.TextItem("", color=ORACLE, anchor=(0.5, 1.0))
        for it in (self.pred_bars, self.meas_bars, self.whiskers, self.star, self.otext):
            self.plot.addItem(it)
        self.nodata = NoData(self.plot, (-0.6, 6.6), (0.0, 100.0))
        self.plot.scene().sigMouseMoved.connect(self._hover)
        self.plot.getPlotItem().vb.sigResized.connect(self._fit_rows)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.quality)
        lay.addWidget(self.regret)
        lay.addWidget(self.info)
        lay.addWidget(self.plot, 1)
        self._key = None
        self._cands: list[dict] = []
        self._chosen = -1
        self._measured: float | None = None
        self._group_labels: list = []
        self._x = np.zeros(0)
        self._fit = None              # per-request view: (top bar, x range, measured label's x, rows)
        self._oracle = None           # the OracleResult shown (oracle view)
        self._auto_oracle = None      # id of the measurement we switched to by ourselves
        self._auto = False
        self._requests_shown = False  # the "every request" view is drawn (its bars reuse the oracle view's)

    def _view_changed(self, _=None) -> None:
        self._auto = False            # the user picked a view: keep it
        self._force_redraw()

    def _set_view(self, i: int) -> None:
        self.which.blockSignals(True)
        self.which.setCurrentIndex(i)
        self.which.blockSignals(False)

    def _force_redraw(self) -> None:
        self._key = None
        if getattr(self, "_state", None) is not None:
            self.refresh(self._state)

    def refresh(self, state: SessionState) -> None:
        self._state = state
        qkey = (id(state), id(state.header), len(state.ends), id(state.decision))
        if qkey != self._quality_key:
            self._quality_key = qkey
            text, tip = quality_text(state)
            self.quality.setText(text)
            self.quality.setToolTip(tip)
        o = state.oracle
        if o is not None and state.oracle_fresh and id(o) != self._auto_oracle:
            self._auto_oracle, self._auto = id(o), True       # a new measurement: show it
            self._set_view(VIEW_ORACLE)
        elif self._auto and not state.oracle_fresh and self.which.currentIndex() == VIEW_ORACLE:
            self._auto = False                               # a request started since: back to it
            self._set_view(VIEW_REQUEST)
        if self.which.currentIndex() == VIEW_ORACLE:
            self._refresh_oracle(o)
            return
        if self.which.currentIndex() == VIEW_REQUESTS:
            self._refresh_requests(state)
            return
        self._clear_oracle()
        per_round = self.which.currentIndex() == 1
        d = state.round_decision if per_round else state.decision
        measured = None if per_round or d is None else state.measured_ms(d.request_id)
        # what the chosen k led to in this request's rounds (since the re-decision), gate copies included
        copies = (state.counts_since(max(d.round, 1), d.action.get("k"))
                  if d is not None and d.request_id == state.request_id else None)
        key = (id(d), measured, copies.copies_accepted if copies is not None else 0)
        if key == self._key:
            return
        self._key = key
        if d is None:
            self._cands, self._chosen, self._measured = [], -1, None
            self.bars.setOpts(x=[], height=[], width=0.7, brushes=None, pens=None)
            self.measured.setOpts(x=[], height=[], width=0.34)
            self.mtext.setText("")
            self._fit = None
            self.info.setText("no decision yet" if not per_round else "no per-round re-decision in this request")
            self.nodata.set(True, "no data yet")
            return
        self.nodata.set(False)
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
        self._set_group_labels(x, cands, top * 1.14)
        if measured is not None and chosen >= 0:
            self.measured.setOpts(x=[x[chosen] + 0.18], height=[measured], width=0.34)
            self.mtext.setText(f"measured {measured:.0f} ms")
        else:
            self.measured.setOpts(x=[], height=[], width=0.34)
            self.mtext.setText("")
        self._x = x
        self._cands, self._chosen, self._measured = cands, chosen, measured
        pred = cands[chosen]["predicted_ms"] if chosen >= 0 else float("nan")
        where = "per-request decision" if d.round < 0 else f"round {d.round} re-decision"
        txt = (f"request {d.request_id} · {where} · chosen (r={act.get('reuse')}, {k_text(act.get('k'), copies)}) "
               f"by {d.reason} · alpha {d.alpha:.2f} · predicted {pred:.0f} ms")
        if copies is not None and copies.copy_rounds:
            txt += (f" · the gate copied {copies.copies_accepted} of {copies.copied} verified tokens in "
                    f"{copies.copy_rounds} round{'s' if copies.copy_rounds != 1 else ''}")
        if d.copy:
            txt += " · priced as the copy of its earlier output"
        txt += passes_text(d, None if per_round else state.measured_passes(d.request_id))
        if measured is not None:
            txt += f" · measured {measured:.0f} ms"
        n_inf = sum(1 for c in cands if not c.get("feasible", True))
        if n_inf:
            txt += f" · {n_inf} infeasible (grey)"
        self.info.setText(txt)
        xr = (float(x.min()) - 0.6, float(x.max()) + 0.6)
        self.plot.getPlotItem().setXRange(*xr, padding=0)
        mx = float(x[chosen]) + 0.18 if measured is not None and chosen >= 0 else None
        self._fit = (top, xr, mx, 1 if mx is None else 2)
        self._fit_rows()

    def _fit_rows(self, *_) -> None:
        """Per-request view: the y range and the labels above the bars, from the plot's size in
        pixels (again on every resize). At the top a row for the group labels (r=0 / r=1), under it
        a row for the measured label (over the chosen action, kept inside the plot), then the bars:
        no label overlaps a bar, another label or the plot's edge, however small the panel."""
        if self._fit is None:
            return
        top, (x0, x1), mx, rows = self._fit
        vb = self.plot.getPlotItem().vb
        h_px, w_px = max(float(vb.height()), 1.0), max(float(vb.width()), 1.0)
        row = max(t.textItem.boundingRect().height() for t in [self.mtext, *self._group_labels])
        ymax = top / (1.0 - min(0.75, (rows * row + 6) / h_px))
        y_px = ymax / h_px
        for t in self._group_labels:
            t.setPos(t.pos().x(), ymax - y_px)
        if mx is not None:
            half = (self.mtext.textItem.boundingRect().width() / 2 + 2) * (x1 - x0) / w_px    # 2 px margin
            cx = (x0 + x1) / 2 if 2 * half >= x1 - x0 else min(max(mx, x0 + half), x1 - half)
            self.mtext.setPos(cx, ymax - (row + 3) * y_px)
        self.plot.getPlotItem().setYRange(0, ymax, padding=0)

    # ------------------------------------------------------------------ oracle view
    def _group_x(self, cands) -> np.ndarray:
        """r = 0 group, a gap, then the r = 1 group."""
        return np.array([i + (1.0 if c["reuse"] == 1 and any(cc["reuse"] == 0 for cc in cands) else 0.0)
                         for i, c in enumerate(cands)])

    def _set_group_labels(self, x, cands, y) -> None:
        for t in self._group_labels:
            self.plot.removeItem(t)
        self._group_labels = []
        for r in (0, 1):
            xs = [xi for xi, c in zip(x, cands) if c["reuse"] == r]
            if xs:
                t = pg.TextItem(f"r={r} ({'reuse' if r else 'no reuse'})", color="#555", anchor=(0.5, 0))
                t.setPos((min(xs) + max(xs)) / 2, y)
                self.plot.addItem(t)
                self._group_labels.append(t)

    def _clear_oracle(self) -> None:
        if self._oracle is None and self.regret.isHidden() and not self._requests_shown:
            return
        self._oracle = None
        self._requests_shown = False
        self.info.setTextFormat(Qt.TextFormat.PlainText)
        self.pred_bars.setOpts(x=[], height=[], width=0.34, brushes=None, pens=None)
        self.meas_bars.setOpts(x=[], height=[], width=0.34, brushes=None, pens=None)
        self.whiskers.setData(x=np.zeros(0), y=np.zeros(0), top=np.zeros(0), bottom=np.zeros(0))
        self.star.setData([], [])
        self.otext.setText("")
        self.regret.hide()
        self.plot.getPlotItem().setLabel("left", "predicted ms")
        self._key = None

    def _refresh_oracle(self, o) -> None:
        key = ("oracle", id(o))
        if key == self._key:
            return
        self._key = key
        self.bars.setOpts(x=[], height=[], width=0.7, brushes=None, pens=None)
        self.measured.setOpts(x=[], height=[], width=0.34)
        self.mtext.setText("")
        self._oracle = o
        self._fit = None
        if o is None:
            self._cands, self._chosen, self._measured = [], -1, None
            self.pred_bars.setOpts(x=[], height=[], width=0.34, brushes=None, pens=None)
            self.meas_bars.setOpts(x=[], height=[], width=0.34, brushes=None, pens=None)
            self.whiskers.setData(x=np.zeros(0), y=np.zeros(0), top=np.zeros(0), bottom=np.zeros(0))
            self.star.setData([], [])
            self.otext.setText("")
            for t in self._group_labels:
                self.plot.removeItem(t)
            self._group_labels = []
            self.regret.hide()
            self.info.setTextFormat(Qt.TextFormat.PlainText)
            self.info.setText("no measurement yet: Run → Measure every action (Ctrl+M) runs every (r, k) "
                              "on the prompt from the same cache state")
            self.nodata.set(True, "no measurement yet")
            return
        self.nodata.set(False)
        cands = sorted(o.actions, key=lambda a: (a["reuse"], a["k"]))
        x = self._group_x(cands)
        is_ = lambda a, d: a["reuse"] == d.get("reuse") and a["k"] == d.get("k")  # noqa: E731
        chosen = next((i for i, a in enumerate(cands) if is_(a, o.choice)), -1)
        best = next((i for i, a in enumerate(cands) if is_(a, o.oracle)), -1)
        pred = np.array([max(0.0, float(a["predicted_ms"] or 0.0)) for a in cands])
        med = np.array([float(a["median_ms"]) for a in cands])
        lo = np.array([float(a["min_ms"]) for a in cands])
        hi = np.array([float(a["max_ms"]) for a in cands])
        self.pred_bars.setOpts(
            x=x - 0.18, height=pred, width=0.34,
            brushes=[CHOSEN if i == chosen else (FEASIBLE if a["feasible"] else INFEASIBLE) for i, a in enumerate(cands)],
            pens=[pg.mkPen("#333", width=2) if i == chosen else pg.mkPen(None) for i in range(len(cands))])
        self.meas_bars.setOpts(
            x=x + 0.18, height=med, width=0.34,
            brushes=[ORACLE if i == best else (MEASURED if a["feasible"] else "#e7a3a3") for i, a in enumerate(cands)],
            pens=[pg.mkPen("#111", width=2) if i == best else pg.mkPen(None) for i in range(len(cands))])
        self.whiskers.setData(x=x + 0.18, y=med, top=hi - med, bottom=med - lo)
        top = max(float(pred.max()), float(hi.max()), 1e-3)
        if best >= 0:
            ys = hi[best] + top * 0.05
            self.star.setData([x[best] + 0.18], [ys])
            self.otext.setText("oracle")
            self.otext.setPos(x[best] + 0.18, ys + top * 0.045)
        self.plot.getPlotItem().setLabel("left", "ms: predicted | measured")
        ax = self.plot.getPlotItem().getAxis("bottom")
        ax.setTicks([[(float(xi), str(a["k"])) for xi, a in zip(x, cands)]])
        self._set_group_labels(x, cands, top * 1.2)
        self._x = x
        self._cands = [{"reuse": a["reuse"], "k": a["k"], "predicted_ms": a["predicted_ms"] or 0.0,
                        "feasible": a["feasible"], "reason": "", "median_ms": a["median_ms"],
                        "min_ms": a["min_ms"], "max_ms": a["max_ms"], "runs_ms": a.get("runs_ms", [])}
                       for a in cands]
        self._chosen, self._measured = chosen, (float(med[chosen]) if chosen >= 0 else None)
        # the regret, stated
        b = cands[best] if best >= 0 else None
        if chosen >= 0 and b is not None and o.regret is not None:
            c = cands[chosen]
            col = ORACLE if o.regret <= 0.02 else ("#d94801" if o.regret <= 0.10 else MEASURED)
            head = ("the controller chose the oracle" if chosen == best else
                    f"the controller's choice (r={c['reuse']}, k={c['k']}) took {c['median_ms']:.0f} ms vs the "
                    f"oracle (r={b['reuse']}, k={b['k']}) {b['median_ms']:.0f} ms")
            self.regret.setText(f"<b>Regret <span style='color:{col}'>{o.regret * 100:+.1f}%</span></b>: {head}"
                                + ("" if chosen != best else f" (r={c['reuse']}, k={c['k']}, {c['median_ms']:.0f} ms)")
                                + (f" · <span style='color:{MEASURED}'><b>{o.mismatch}</b></span>" if not o.exact else ""))
        else:
            self.regret.setText("<b>no controller choice</b> (fixed policy or no cost profile): oracle "
                                + (f"(r={b['reuse']}, k={b['k']}) {b['median_ms']:.0f} ms" if b else "—"))
        self.regret.show()
        state = ("exact repeat" if o.exact_repeat else (f"hit q = {o.hit_tokens}" if o.hit_tokens else "miss"))
        txt = (f"measured after request {o.after_request} · P = {o.prompt_tokens} ({state}), "
               f"{o.output_tokens} tokens out · {o.repeats} runs per action, median with min–max whisker · "
               f"<span style='color:{FEASIBLE}'>■</span> predicted (<span style='color:{CHOSEN}'>■</span> chosen by "
               f"{o.choice_reason or '—'}) · <span style='color:{MEASURED}'>■</span> measured "
               f"(<span style='color:{ORACLE}'>■</span> oracle)")
        if o.adaptive_ms is not None:
            txt += f" · adaptive policy itself {o.adaptive_ms:.0f} ms"
        txt += " · outputs identical ✓" if o.exact else " · <b>outputs differ</b>"
        n_inf = sum(1 for a in cands if not a["feasible"])
        if n_inf:
            txt += f" · {n_inf} infeasible (pale)"
        self.info.setTextFormat(Qt.TextFormat.RichText)
        self.info.setText(txt)
        self.plot.getPlotItem().setXRange(float(x.min()) - 0.6, float(x.max()) + 0.6, padding=0)
        self.plot.getPlotItem().setYRange(0, top * 1.32, padding=0)

    # ------------------------------------------------------------------ every request
    def _refresh_requests(self, state: SessionState) -> None:
        """Each finished request's predicted cost (the chosen action's, blue) beside its measured
        latency (red), the latest MAX_REQUESTS_SHOWN."""
        rows = state.prediction_errors()[-MAX_REQUESTS_SHOWN:]
        key = ("requests", id(state), len(state.ends))
        if key == self._key:
            return
        if self._oracle is not None or not self.regret.isHidden():
            self._clear_oracle()
        self._key = key
        self._requests_shown = True
        self._fit = None
        self.bars.setOpts(x=[], height=[], width=0.7, brushes=None, pens=None)
        self.measured.setOpts(x=[], height=[], width=0.34)
        self.mtext.setText("")
        self.whiskers.setData(x=np.zeros(0), y=np.zeros(0), top=np.zeros(0), bottom=np.zeros(0))
        self.star.setData([], [])
        self.otext.setText("")
        for t in self._group_labels:
            self.plot.removeItem(t)
        self._group_labels = []
        self._chosen, self._measured = -1, None
        if not rows:
            self._cands, self._x = [], np.zeros(0)
            self.pred_bars.setOpts(x=[], height=[], width=0.34, brushes=None, pens=None)
            self.meas_bars.setOpts(x=[], height=[], width=0.34, brushes=None, pens=None)
            self.info.setTextFormat(Qt.TextFormat.PlainText)
            self.info.setText("no finished request with a prediction yet (the adaptive policies predict)")
            self.nodata.set(True, "no data yet")
            return
        self.nodata.set(False)
        x = np.arange(len(rows), dtype=float)
        pred = np.array([p for _, p, _ in rows])
        meas = np.array([m for _, _, m in rows])
        good = [abs(p - m) / m <= GOOD_ERROR for _, p, m in rows]
        self.pred_bars.setOpts(x=x - 0.18, height=pred, width=0.34, brushes=[FEASIBLE] * len(rows),
                               pens=[pg.mkPen(None)] * len(rows))
        self.meas_bars.setOpts(x=x + 0.18, height=meas, width=0.34,
                               brushes=[MEASURED if not g else "#e7a3a3" for g in good],
                               pens=[pg.mkPen(None)] * len(rows))
        self.plot.getPlotItem().setLabel("left", "ms: predicted | measured")
        self.plot.getPlotItem().getAxis("bottom").setTicks([[(float(xi), str(r)) for xi, (r, _, _) in zip(x, rows)]])
        self._x = x
        self._cands = [{"reuse": -1, "k": -1, "request_id": r, "predicted_ms": p, "measured_ms": m, "feasible": True}
                       for r, p, m in rows]
        n_good = sum(good)
        self.info.setTextFormat(Qt.TextFormat.RichText)
        self.info.setText(f"per request (x: request id): <span style='color:{FEASIBLE}'>■</span> predicted cost of "
                          f"the chosen action · <span style='color:{MEASURED}'>■</span> measured latency (pale: within "
                          f"{GOOD_ERROR:.0%} of the prediction) · {n_good} of {len(rows)} within {GOOD_ERROR:.0%}")
        top = max(float(pred.max()), float(meas.max()), 1e-3)
        self.plot.getPlotItem().setXRange(-0.6, len(rows) - 0.4, padding=0)
        self.plot.getPlotItem().setYRange(0, top * 1.1, padding=0)

    def _tip(self, i: int) -> str:
        c = self._cands[i]
        if "request_id" in c:
            m, p = c["measured_ms"], c["predicted_ms"]
            return (f"request {c['request_id']}: predicted {p:.0f} ms, measured {m:.0f} ms "
                    f"({(p - m) / m * 100:+.0f}% off)")
        tip = f"r={c['reuse']}, k={c['k']}: predicted {c['predicted_ms']:.1f} ms"
        if "median_ms" in c:
            runs = "; ".join(f"{v:.0f}" for v in c["runs_ms"])
            tip += f"\nmeasured median {c['median_ms']:.1f} ms (min {c['min_ms']:.1f}, max {c['max_ms']:.1f}; runs {runs})"
            o = self._oracle
            if o is not None and o.oracle == {"reuse": c["reuse"], "k": c["k"]}:
                tip += "\noracle: the fastest feasible action"
        if i == self._chosen:
            tip += " · chosen" if "median_ms" in c else " (chosen)"
            if self._measured is not None and "median_ms" not in c:
                tip += f"\nmeasured {self._measured:.1f} ms (RequestEnd.latency_ms)"
        if not c.get("feasible", True):
            tip += f"\ninfeasible: {c.get('reason') or 'not allowed'}"
        return tip

    def _hover(self, pos) -> None:
        vb = self.plot.getPlotItem().vb
        if not self._cands or not vb.sceneBoundingRect().contains(pos):
            return
        p = vb.mapSceneToView(pos)
        tip = ""
        i = int(np.argmin(np.abs(self._x - p.x()))) if len(self._x) else -1
        if i >= 0 and abs(p.x() - self._x[i]) <= 0.35:
            tip = self._tip(i)
        self.plot.setToolTip(tip)

    def tooltip_at(self, i: int) -> str:
        """The tooltip text of bar i (what hovering shows)."""
        return self._tip(i)

    def snapshot(self) -> dict:
        o = self._oracle
        return {"info": self.info.text(), "view": self.which.currentIndex(), "empty": bool(self.nodata.empty),
                "quality": self.quality.text(),
                "bars": [(c["reuse"], c["k"], c["predicted_ms"], c.get("feasible", True)) for c in self._cands],
                "chosen": self._chosen, "measured": self._measured,
                "oracle": None if o is None else {
                    "regret": self.regret.text(), "best": o.oracle, "choice": o.choice,
                    "measured": [(c["reuse"], c["k"], c["median_ms"], c["min_ms"], c["max_ms"]) for c in self._cands]}}
