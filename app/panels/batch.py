"""Batch: the requests decoding together (``rakv serve --parallel N``, attached or replayed).

A table of the active requests (started, not ended): each one's rows in the latest shared step,
its current k (of its latest Round or Decision), the steps it shared, its tokens so far. Clicking
a request shows it in the other panels (token stream, action costs, acceptance, round timeline,
token tree); *Follow the newest* goes back to showing the newest request. Under the table, the
last ``SHOW_STEPS`` shared steps (``rakv.records.Step``): rows per step stacked by request (the
shown request outlined), and each step's measured ms beside its predicted ms where the record
carries one (``predicted_ms``). Drawn from ``SessionState`` on the window's redraw timer only.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QHBoxLayout, QHeaderView, QLabel, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.state import SessionState

from . import NoData, ShortPlot, make_plot, nice_ceiling

SHOW_STEPS = 100
# a request's colour (rows plot, table swatch): by its id, 8 colours (one bar item each: pyqtgraph's fast path)
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
COLUMNS = ("request", "k", "rows", "steps", "tokens", "prompt")
TIPS = ("request id (its colour in the rows plot); click to show it in the other panels",
        "its current k: of its latest round or decision (0: no drafts)",
        "rows it fed to the latest shared step: 1 a decode step, 1 + k a verify, more: a prompt chunk",
        "shared steps it took part in",
        "tokens generated / max new tokens",
        "prompt tokens")


def typical_top(v: np.ndarray) -> float:
    """The y range's top: the steps' 90th percentile (and the latest step), so the decode steps stay
    readable beside a prompt's long chunk (whose bar then runs past the top)."""
    return max(float(np.percentile(v, 90)), float(v[-1]), 1.0)


def request_color(rid: int) -> str:
    return PALETTE[rid % len(PALETTE)]


class BatchPanel(QWidget):
    requestSelected = Signal(object)     # a request id, or None: follow the newest
    firstSteps = Signal()                # a shown session's first shared step (its dock comes forward)

    def __init__(self):
        super().__init__()
        self.info = QLabel("no shared steps yet")
        self.info.setWordWrap(True)
        self.info.setToolTip("`rakv serve --parallel N` decodes up to N requests together: every step one forward\n"
                             "carries each active request's rows. File > Attach to server shows a running one;\n"
                             "a recording of one replays here too.")
        self.follow = QCheckBox("Follow the newest request")
        self.follow.setChecked(True)
        self.follow.setToolTip("checked: the panels show the newest request; click a request in the table to\n"
                               "show that one instead")
        self.follow.toggled.connect(self._follow_toggled)
        self.shown_label = QLabel("")
        top = QHBoxLayout()
        top.addWidget(self.follow)
        top.addWidget(self.shown_label, 1)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        for i, tip in enumerate(TIPS):
            self.table.horizontalHeaderItem(i).setToolTip(tip)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        self.table.setMinimumHeight(self.table.horizontalHeader().sizeHint().height() + 2 * (self.fontMetrics().height() + 6))
        self.table.cellClicked.connect(self._clicked)
        # one plot: rows per step stacked by request (bars, left axis), ms per step (line, right axis)
        self.plot = make_plot("rows (bars)", "step", ShortPlot)
        self.plot.setMinimumHeight(130)
        pi = self.plot.getPlotItem()
        pi.disableAutoRange()
        self.ms_vb = pg.ViewBox()
        self.ms_vb.disableAutoRange()
        self.ms_vb.setMouseEnabled(x=False, y=False)
        pi.showAxis("right")
        pi.scene().addItem(self.ms_vb)
        right = pi.getAxis("right")
        right.linkToView(self.ms_vb)
        right.setLabel("ms (line)", color="#2166ac")
        right.enableAutoSIPrefix(False)
        self.ms_vb.setXLink(pi)
        pi.vb.sigResized.connect(self._sync_views)
        self.plot.setToolTip("bars: the rows each shared step carried, stacked by request (colours as in the table;\n"
                             "the shown request outlined; a prompt's long chunk may run past the top)\n"
                             "blue line: each step's measured ms; red dashed: its predicted ms, where the record "
                             "carries one")
        self.bars = [pg.BarGraphItem(x=[], height=[], width=0.8, pen=None, brush=pg.mkBrush(c)) for c in PALETTE]
        for b in self.bars:
            pi.addItem(b)
        self.outline = pg.BarGraphItem(x=[], height=[], width=0.8, brush=None, pen=pg.mkPen("#222", width=1.5))
        pi.addItem(self.outline)
        self.measured = pg.PlotDataItem([], [], pen=pg.mkPen(33, 102, 172, 170, width=1), symbol="o", symbolSize=3,
                                        symbolBrush="#2166ac", symbolPen=None)
        self.predicted = pg.PlotDataItem([], [], pen=pg.mkPen("#d6604d", width=1.5, style=Qt.PenStyle.DashLine),
                                         connect="finite")
        self.ms_vb.addItem(self.measured)
        self.ms_vb.addItem(self.predicted)
        self.legend = pi.addLegend(offset=(10, 5), labelTextSize="8pt", colCount=2)
        self.legend.addItem(self.measured, "measured ms")
        self.legend.addItem(self.predicted, "predicted ms")
        self.legend.setVisible(False)
        self.nodata = NoData(self.plot, (0.0, float(SHOW_STEPS)), (0.0, 4.0), "no shared steps yet")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.info)
        lay.addLayout(top)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.plot, 2)
        self._state: SessionState | None = None
        self._raised_for = None
        self._ids: list[int] = []
        self._key = None
        self._plot_key = None
        self._ranges = None

    # ------------------------------------------------------------------ selection
    def _clicked(self, row: int, _col: int = 0) -> None:
        if 0 <= row < len(self._ids):
            self.select(self._ids[row])

    def select(self, request_id: int | None) -> None:
        """Show ``request_id`` in the panels (None: follow the newest)."""
        st = self._state
        if st is not None:
            st.select(request_id)
        self.follow.blockSignals(True)
        self.follow.setChecked(request_id is None or st is None or st.selected is None)
        self.follow.blockSignals(False)
        self._key = None
        self.requestSelected.emit(None if st is None else st.selected)

    def _follow_toggled(self, on: bool) -> None:
        if on:
            self.select(None)
        elif self._state is not None:
            self.select(self._state.shown.request_id if self._state.views else None)

    # ------------------------------------------------------------------ drawing
    def refresh(self, state: SessionState) -> None:
        if state is not self._state:
            self._state = state
            self.follow.blockSignals(True)
            self.follow.setChecked(state.selected is None)
            self.follow.blockSignals(False)
        if state.selected is None and not self.follow.isChecked():     # the selected request was dropped
            self.follow.setChecked(True)
        if state.steps and self._raised_for is not state:
            self._raised_for = state
            self.firstSteps.emit()
        shown = state.shown
        key = (id(state), state.version)
        if key == self._key:
            return
        self._key = key
        active = state.active()
        self._fill_table(active, shown.request_id)
        self.shown_label.setText("" if shown.request_id < 0 else
                                 f"panels show request {shown.request_id}"
                                 + ("" if shown.active else " (done)" if shown.end is not None else " (closed)"))
        self.info.setText(self._info_text(state, active))
        pkey = (id(state), state.n_steps, shown.request_id)
        if pkey != self._plot_key:
            self._plot_key = pkey
            self._draw_steps(state, shown.request_id)

    def _fill_table(self, active, shown_id: int) -> None:
        ids = [v.request_id for v in active]
        if ids != self._ids:
            self._ids = ids
            self.table.setRowCount(len(ids))
            for row, v in enumerate(active):
                for col in range(len(COLUMNS)):
                    if self.table.item(row, col) is None:
                        self.table.setItem(row, col, QTableWidgetItem())
                it = self.table.item(row, 0)
                it.setData(Qt.ItemDataRole.DecorationRole, QColor(request_color(v.request_id)))
        for row, v in enumerate(active):
            vals = (str(v.request_id), "—" if v.k is None else str(v.k),
                    str(v.last_rows) if v.steps else "—", str(v.steps),
                    f"{v.generated} / {v.max_new_tokens}" if v.max_new_tokens else str(v.generated),
                    str(v.prompt_tokens))
            bold = v.request_id == shown_id
            for col, text in enumerate(vals):
                it = self.table.item(row, col)
                if it.text() != text:
                    it.setText(text)
                f = it.font()
                if f.bold() != bold:
                    f.setBold(bold)
                    it.setFont(f)
                it.setBackground(QBrush(QColor("#eef3fb")) if bold else QBrush())
        row = ids.index(shown_id) if shown_id in ids else -1
        if row != self.table.currentRow():
            self.table.blockSignals(True)
            if row >= 0:
                self.table.selectRow(row)
                self.table.scrollToItem(self.table.item(row, 0))
            else:
                self.table.clearSelection()
                self.table.setCurrentCell(-1, -1)
            self.table.blockSignals(False)

    @staticmethod
    def _info_text(state: SessionState, active) -> str:
        n = len(active)
        head = f"{n} active request{'s' if n != 1 else ''}"
        if not state.steps:
            return head + " · no shared steps yet (`rakv serve --parallel N`: attach to it or replay its recording)"
        s = state.steps[-1]
        txt = f"{head} · {state.n_steps} shared steps · step {s.step}: {s.total} rows of {len(s.rows)}, {s.ms:.1f} ms"
        if s.predicted_ms is not None:
            err = (s.ms - s.predicted_ms) / s.predicted_ms if s.predicted_ms > 0 else None
            txt += f" (predicted {s.predicted_ms:.1f} ms" + (f", {err:+.0%})" if err is not None else ")")
        if not s.shared:
            txt += " · each request's forward ran alone inside the step"
        if state.move is not None and n > 1:          # (the move of requests still running)
            K, n_move, _ = state.move
            txt += (f" · joint move of {n_move} requests: K = {K}" if K else
                    f" · joint move of {n_move} requests: plain steps")
        last = state.steps[-SHOW_STEPS:]
        rows = sum(p.total for p in last)
        ms = sum(p.ms for p in last)
        if rows:
            txt += f" · last {len(last)}: {rows / len(last):.1f} rows, {ms / len(last):.1f} ms a step"
        return txt

    def _draw_steps(self, state: SessionState, shown_id: int) -> None:
        pts = state.steps[-SHOW_STEPS:]
        per = [([], [], []) for _ in PALETTE]          # x, height, y0 per colour
        ox, oh, oy = [], [], []
        for p in pts:
            y = 0.0
            for rid, n in p.rows:
                xs, hs, ys = per[rid % len(PALETTE)]
                xs.append(p.step)
                hs.append(n)
                ys.append(y)
                if rid == shown_id:
                    ox.append(p.step)
                    oh.append(n)
                    oy.append(y)
                y += n
        for b, (xs, hs, ys) in zip(self.bars, per):
            b.setOpts(x=np.array(xs, float), height=np.array(hs, float), y0=np.array(ys, float))
        self.outline.setOpts(x=np.array(ox, float), height=np.array(oh, float), y0=np.array(oy, float))
        x = np.array([p.step for p in pts], float)
        ms = np.array([p.ms for p in pts], float)
        pred = np.array([np.nan if p.predicted_ms is None else p.predicted_ms for p in pts], float)
        # the line breaks where steps were not shared (one request alone, or none): no slope across a gap
        link = np.concatenate([np.diff(x) <= 1, [True]]) if len(x) > 1 else "all"
        self.measured.setData(x, ms, connect=link)
        has_pred = bool(np.isfinite(pred).any())
        if has_pred and len(x) > 1:
            ok = np.isfinite(pred)
            self.predicted.setData(x[ok], pred[ok], connect=(link & np.concatenate([ok[1:], [False]]))[ok])
        else:
            self.predicted.setData(x[np.isfinite(pred)], pred[np.isfinite(pred)])
        self.legend.setVisible(has_pred)
        self.nodata.set(not pts)
        if pts:
            rows = np.array([p.total for p in pts], float)
            both = np.concatenate([ms, pred[np.isfinite(pred)]])
            self._range(float(x[0]), float(x[-1]), typical_top(rows), typical_top(both))
        else:
            self._ranges = None

    def _range(self, lo: float, hi: float, rows: float, ms: float) -> None:
        """Stepped ranges: the axes change only when the data outgrows them."""
        xr = (lo - 0.5, lo + nice_ceiling(max(float(SHOW_STEPS), hi - lo + 1)))
        yr = (0.0, nice_ceiling(rows * 1.15))
        mr = (0.0, nice_ceiling(ms * 1.3))       # headroom for the legend
        if (xr, yr, mr) != self._ranges:
            self._ranges = (xr, yr, mr)
            self.plot.getPlotItem().setXRange(*xr, padding=0)
            self.plot.getPlotItem().setYRange(*yr, padding=0)
            self.ms_vb.setYRange(*mr, padding=0)

    def _sync_views(self, *_) -> None:
        """The ms view box over the plot's own (pyqtgraph's second axis)."""
        vb = self.plot.getPlotItem().vb
        self.ms_vb.setGeometry(vb.sceneBoundingRect())
        self.ms_vb.linkedViewChanged(vb, self.ms_vb.XAxis)

    def snapshot(self) -> dict:
        st = self._state
        shown = st.shown.request_id if st is not None else -1
        rows = {int(self.table.item(r, 0).text()): self.table.item(r, 2).text() for r in range(self.table.rowCount())}
        ks = {int(self.table.item(r, 0).text()): self.table.item(r, 1).text() for r in range(self.table.rowCount())}
        x, _ = self.measured.getData()
        _, py = self.predicted.getData()
        return {"active": list(self._ids), "rows": rows, "k": ks, "shown": shown,
                "follow": self.follow.isChecked(), "info": self.info.text(), "shown_text": self.shown_label.text(),
                "steps": 0 if x is None else len(x),
                "predicted": 0 if py is None else int(np.isfinite(py).sum()),
                "bars": sum(len(b.opts["x"]) for b in self.bars), "outlined": len(self.outline.opts["x"]),
                "empty": bool(self.nodata.empty)}


def install(win) -> BatchPanel:
    """The Batch panel as a dock of ``win`` (a MainWindow), a tab beside the prefix cache's
    (``win.batch_dock``, in the View menu): redrawn with the plot panels, its selection redraws the
    window, and its tab comes forward once a shown session has its first shared step."""
    from PySide6.QtWidgets import QDockWidget

    panel = BatchPanel()
    d = QDockWidget("Batch", win)
    d.setObjectName("dock_batch")
    d.setWidget(panel)
    d.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable | QDockWidget.DockWidgetFeature.DockWidgetClosable
                  | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
    win.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, d)
    win.tabifyDockWidget(win.docks["cache"], d)
    win.docks["cache"].raise_()
    win.batch_dock = d                        # (not in win.docks: those are the first screen's six)
    win.plots.append(panel)
    panel.requestSelected.connect(lambda _rid: win.redraw())
    panel.firstSteps.connect(d.raise_)
    return panel
