"""Prefix-cache panel: hit q of P, bytes used vs budget, entries, evictions, hits per request."""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFormLayout, QHBoxLayout, QLabel, QProgressBar, QVBoxLayout, QWidget

from app.state import SessionState

from . import NoData, ShortPlot, make_plot

MiB = 1024 * 1024


def mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n < 100 * MiB else f"{n / MiB:.0f} MiB"


class CachePanel(QWidget):
    def __init__(self):
        super().__init__()
        self.hit = QLabel("no lookup yet")
        self.hit.setStyleSheet("font-size: 15px; font-weight: 600;")
        self.hit.setWordWrap(True)        # two lines in a narrow window rather than a wider dock
        self.detail = QLabel("")
        self.detail.setWordWrap(True)
        self.bytes = QProgressBar()
        self.bytes.setRange(0, 1000)
        self.bytes.setFormat("0 of 0 MiB")
        self.entries = QLabel("0")
        self.evictions = QLabel("0")
        self.draft = QLabel("—")
        self.template = QLabel("—")
        self.template.setWordWrap(True)
        self.conversation = QLabel("—")
        self.conversation.setWordWrap(True)
        self.conversation.setToolTip("conversation mode: how much of this turn's prompt (the whole conversation) the "
                                     "prefix cache served from the turns before it, prompts and answers")
        self.template.setToolTip("chat-templated prompts all start with the template's system prompt and user "
                                 "header (S tokens): the prefix cache reuses that on every request")
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        counts = QHBoxLayout()
        counts.setContentsMargins(0, 0, 0, 0)
        for text, w in (("Entries", self.entries), ("Evictions", self.evictions)):
            counts.addWidget(QLabel(text))
            counts.addWidget(w)
            counts.addSpacing(12)
        counts.addStretch(1)
        form.addRow("Bytes used", self.bytes)
        form.addRow(counts)
        # the long lines below the form, each wrapped in a box layout (a form row would overlap them)
        self.draft_line = QLabel("<b>Draft cache:</b> —")
        self.template_line = QLabel("<b>Chat template:</b> —")
        self.conversation_line = QLabel("<b>Conversation:</b> —")
        for lab, tip in ((self.draft_line, self.draft), (self.template_line, self.template),
                         (self.conversation_line, self.conversation)):
            lab.setWordWrap(True)
            lab.setTextFormat(Qt.TextFormat.RichText)
            lab.setToolTip(tip.toolTip())
        self.plot = make_plot("tokens", "request: hit q (blue) of prompt P (grey)", ShortPlot)     # (it scrolls)
        self.plot.setMinimumHeight(90)
        self.plot.setToolTip("per request: the prefix-cache hit q (blue) over the prompt's P tokens (grey); in "
                             "conversation mode labelled conversation.turn")
        self.p_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush="#d9d9d9", pen=None)
        self.q_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush="#6baed6", pen=None)
        self.plot.addItem(self.p_bars)
        self.plot.addItem(self.q_bars)
        self.nodata = NoData(self.plot, (-0.6, 4.6), (0.0, 100.0))
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.hit)
        lay.addWidget(self.detail)
        lay.addLayout(form)
        lay.addWidget(self.draft_line)
        lay.addWidget(self.template_line)
        lay.addWidget(self.conversation_line)
        lay.addWidget(self.plot, 1)
        self._hits_n = -1
        self._state_id = None

    @staticmethod
    def _tick(state: SessionState, rid: int) -> str:
        """A request's label on the bars' axis: its id, or c.t (conversation, turn) in a conversation."""
        t = state.turn_of(rid)
        return f"{t.conversation}.{t.turn}" if t is not None else str(rid)

    def refresh(self, state: SessionState) -> None:
        c = state.cache
        if state.hits:
            self.hit.setText(f"hit q = {c.hit_tokens} of P = {c.prompt_tokens} tokens")
            if c.exact_repeat:
                d = "exact repeat: all KV and the stored next-token logits reused (no target forward)"
            elif c.hit_tokens > 0:
                d = (f"partial hit: {c.reused_tokens} positions cloned, boundary token recomputed, "
                     f"{c.prompt_tokens - c.reused_tokens} prefilled in {c.prefill_ms:.1f} ms")
            else:
                d = f"miss: {c.prompt_tokens} tokens prefilled in {c.prefill_ms:.1f} ms"
            d += " · stored" if c.stored else " · not stored"
            self.detail.setText(d)
        budget = max(1, c.budget)
        self.bytes.setValue(int(1000 * min(1.0, c.bytes_used / budget)))
        self.bytes.setFormat(f"{mib(c.bytes_used)} of {mib(c.budget)}" if state.hits else "—")
        self.entries.setText(str(c.entries))
        self.evictions.setText(str(c.evictions))
        self.template.setText(state.template_note())
        self.conversation.setText(state.conversation_note())
        self.template_line.setText(f"<b>Chat template:</b> {html.escape(self.template.text())}")
        self.conversation_line.setText(f"<b>Conversation:</b> {html.escape(self.conversation.text())}")
        # a conversation's turn: its line says what the hit is; the template's would repeat it less clearly
        in_conv = state.turn is not None and state.turn.request_id == state.request_id
        self.template_line.setVisible(not in_conv)
        self.conversation_line.setVisible(in_conv or not state.turns)
        dc = state.draft_cache
        self.draft.setText("—" if dc is None else
                           f"hit q = {dc.hit_tokens} of {dc.prompt_tokens}"
                           + (" (exact)" if dc.exact_repeat else "") + f", prefill {dc.prefill_ms:.1f} ms")
        self.draft_line.setText(f"<b>Draft cache:</b> {html.escape(self.draft.text())}")
        if len(state.hits) != self._hits_n or id(state) != self._state_id:
            self._hits_n, self._state_id = len(state.hits), id(state)
            h = state.hits[-40:]
            self.nodata.set(not h)
            conv = any(state.turn_of(rid) for rid, *_ in h)
            self.plot.getPlotItem().setLabel("bottom", ("turn (conversation.turn)" if conv else "request")
                                             + ": hit q (blue) of prompt P (grey)")
            x = np.array([rid for rid, *_ in h], dtype=float)
            self.p_bars.setOpts(x=x, height=np.array([P for _, _, P, _ in h], dtype=float))
            self.q_bars.setOpts(x=x, height=np.array([q for _, q, _, _ in h], dtype=float))
            if len(x):
                pi = self.plot.getPlotItem()
                pi.setXRange(x.min() - 0.6, x.max() + 0.6, padding=0)
                pi.setYRange(0, max(1, max(P for _, _, P, _ in h)) * 1.1, padding=0)
                step = max(1, len(x) // 10)
                pi.getAxis("bottom").setTicks([[(float(v), self._tick(state, int(v))) for v in x[::step]]])

    def snapshot(self) -> dict:
        return {"hit": self.hit.text(), "detail": self.detail.text(), "bytes": self.bytes.format(),
                "bytes_value": self.bytes.value(), "entries": self.entries.text(),
                "evictions": self.evictions.text(), "draft": self.draft.text(), "template": self.template.text(), "hits": self._hits_n,
                "conversation": self.conversation.text(), "empty": bool(self.nodata.empty),
                "ticks": [t for _, t in (self.plot.getPlotItem().getAxis("bottom")._tickLevels or [[]])[0]]}
