"""Chat: the session's requests as a transcript (the user's text, the answer), special tokens and the
system prompt hidden unless *Show template* is ticked; Copy answer; Export conversation (Markdown or
JSON). The token stream tab beside it keeps the provenance colours."""

from __future__ import annotations

import html

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QTextBrowser,
                               QVBoxLayout, QWidget)

from app import transcript as T
from app.state import SessionState

USER_BG = "#eef3fb"
ANSWER_BG = "#ffffff"
TEMPLATE_FG = "#6a4c93"


class ChatPanel(QWidget):
    copyRequested = Signal()
    exportRequested = Signal()

    def __init__(self, pieces_of=None):
        """``pieces_of()`` gives the current id -> text lookup (the live tokenizer's, or a replay's)."""
        super().__init__()
        self.pieces_of = pieces_of or (lambda: (lambda tid: f"<{tid}>"))
        self.pieces = self.pieces_of()
        self.state: SessionState | None = None
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        f = self.view.font()
        f.setPointSize(f.pointSize() + 1)
        self.view.setFont(f)
        self.show_template = QCheckBox("Show template")
        self.show_template.setToolTip("show each prompt as fed to the model (system prompt, role markers, special "
                                      "tokens) and the answers' special tokens")
        self.show_template.toggled.connect(lambda _: self._force())
        self.copy = QPushButton("Copy answer")
        self.copy.setToolTip("copy the latest answer to the clipboard (as plain text)")
        self.copy.clicked.connect(self.copyRequested)
        self.export = QPushButton("Export ...")       # File → Export conversation ... says it in full
        self.export.setToolTip("Export conversation (Ctrl+Shift+E): save the transcript as Markdown (.md) or "
                               "JSON (.json)")
        self.export.clicked.connect(self.exportRequested)
        self.info = QLabel("")
        self.info.setStyleSheet("color: #555;")
        # the counts take the room that is left (in a narrow window the side docks' forms come first)
        self.info.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        top = QHBoxLayout()
        top.addWidget(self.show_template)
        top.addStretch(1)
        top.addWidget(self.info)
        top.addWidget(self.copy)
        top.addWidget(self.export)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.view, 1)
        self._key = None
        self._html = ""

    def _force(self) -> None:
        self._key = None
        if self.state is not None:
            self.refresh(self.state)

    def messages(self) -> list[T.Message]:
        st = self.state
        self.pieces = self.pieces_of()
        return T.messages(st.exchanges, self.pieces, self.show_template.isChecked()) if st is not None else []

    # ------------------------------------------------------------------ drawing
    def refresh(self, state: SessionState) -> None:
        self.state = state
        self.pieces = self.pieces_of()
        ex = state.exchanges
        key = (id(state), id(self.pieces), len(ex), self.show_template.isChecked(), state.chat_version)
        if key == self._key:
            return
        self._key = key
        self.copy.setEnabled(bool(ex))
        self.export.setEnabled(bool(ex))
        n_conv = len({e.conversation for e in ex if e.conversation is not None})
        self.info.setText(f"{len(ex)} request{'s' if len(ex) != 1 else ''}"
                          + (f" · {n_conv} conversation{'s' if n_conv != 1 else ''}" if n_conv else ""))
        self.info.setToolTip(self.info.text())
        sb = self.view.verticalScrollBar()
        at_end = sb.value() >= sb.maximum() - 4
        self._html = self.render(state)
        self.view.setHtml(self._html)
        if at_end:
            sb.setValue(sb.maximum())

    def render(self, state: SessionState) -> str:
        if not state.exchanges:
            return ("<p style='color:#8c8c8c'>No request yet: type a prompt and Run (Ctrl+R). Each request shows "
                    "here as your message and the model's answer; the Token stream tab shows where every token "
                    "came from.</p>")
        tpl = self.show_template.isChecked()
        parts = []
        for title, exs in T.groups(state.exchanges):
            parts.append(f"<h3 style='color:#444; margin-top:10px'>{html.escape(title)}</h3>")
            for m in T.messages(exs, self.pieces, tpl):
                parts.append(self._bubble(m, tpl))
        return "".join(parts)

    def _bubble(self, m: T.Message, tpl: bool) -> str:
        text = m.content
        if m.role == "user":
            who = "You" + (f" · turn {m.turn}" if m.turn else "") + (" · the prompt as fed" if tpl else "")
            bg = USER_BG
        else:
            bits = [f"{m.tokens} tokens"]
            if m.latency_ms is not None:
                bits.append(f"{m.latency_ms:.0f} ms")
            if m.stopped:
                bits.append(m.stopped)
            elif not m.done:
                bits.append("generating …")
            who = f"Model · request {m.request_id} · " + ", ".join(bits)
            bg = ANSWER_BG
        style = "font-family: monospace; color:" + TEMPLATE_FG if tpl else ""
        body = html.escape(text) if text else "<i style='color:#999'>(empty)</i>"
        return (f"<table width='100%' cellpadding='6' style='margin-bottom:6px; background:{bg}; "
                f"border:1px solid #d0d7e2'><tr><td>"
                f"<div style='color:#666; font-size:small'>{html.escape(who)}</div>"
                f"<div style='white-space:pre-wrap; {style}'>{body}</div></td></tr></table>")

    def snapshot(self) -> dict:
        return {"text": self.view.toPlainText(), "messages": [(m.role, m.content) for m in self.messages()],
                "template": self.show_template.isChecked()}
