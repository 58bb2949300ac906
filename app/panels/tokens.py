"""Token stream of the current request, coloured by provenance, with a legend and hover details."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import QLabel, QTextEdit, QToolTip, QVBoxLayout, QWidget

from app.state import COPY, DRAFT, KINDS, SessionState, Tok, is_copy_round

from . import PROVENANCE_COLORS, PROVENANCE_LABELS

TOKEN_PROP = QTextFormat.Property.UserProperty + 1


def visible(piece: str) -> str:
    """Make whitespace-only pieces visible; keep real line breaks."""
    if piece == "":
        return "\u2205"
    return piece.replace("\n", "\u21b5\n").replace("\t", "\u2192   ")


class TokenView(QTextEdit):
    def __init__(self, panel: "TokenPanel"):
        super().__init__()
        self.panel = panel
        self.setReadOnly(True)
        self.setMouseTracking(True)
        self.setLineWrapMode(QTextEdit.LineWrapMode.WidgetWidth)
        f = self.font()
        f.setPointSize(f.pointSize() + 1)
        self.setFont(f)

    def viewportEvent(self, ev) -> bool:
        if ev.type() == QEvent.Type.ToolTip:
            cur = self.cursorForPosition(ev.pos())
            # the character under the mouse is the one after the cursor position
            cur.movePosition(QTextCursor.MoveOperation.NextCharacter, QTextCursor.MoveMode.KeepAnchor)
            idx = cur.charFormat().property(TOKEN_PROP)
            text = self.panel.tooltip(idx) if idx is not None else ""
            if text:
                QToolTip.showText(ev.globalPos(), text, self)
            else:
                QToolTip.hideText()
            return True
        return super().viewportEvent(ev)


class TokenPanel(QWidget):
    def __init__(self, pieces=None):
        super().__init__()
        self.pieces = pieces or (lambda tid: f"<{tid}>")
        self.state: SessionState | None = None
        self.view = TokenView(self)
        self.title = QLabel("No request yet")
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.TextFormat.PlainText)
        # the legend wraps (one label of coloured spans): a narrow window keeps it whole
        self.legend = QLabel(" ".join(
            f"<span style='background:{PROVENANCE_COLORS[k]};'>&nbsp;{PROVENANCE_LABELS[k].replace(' ', '&nbsp;')}"
            "&nbsp;</span>"
            for k in KINDS))
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.legend.setToolTip("token colours: " + ", ".join(PROVENANCE_LABELS[k] for k in KINDS))
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.title)
        lay.addWidget(self.legend)
        lay.addWidget(self.view, 1)
        self._fmt = {}
        for kind, col in PROVENANCE_COLORS.items():
            f = QTextCharFormat()
            f.setBackground(QColor(col))
            self._fmt[kind] = f
        self._key = None          # (request id, prompt signature) currently rendered
        self._n = 0               # tokens rendered
        self._kinds: dict[str, int] = {}   # output tokens rendered, by kind (what the colours count)

    # ------------------------------------------------------------------ drawing
    def refresh(self, state: SessionState) -> None:
        self.state = state
        toks = state.tokens
        P = state.prompt_tokens
        key = (id(state), state.request_id, tuple(t.kind for t in toks[:P]))
        if key != self._key or len(toks) < self._n:
            self.view.clear()
            self._key, self._n = key, 0
            self._kinds = {}
        if len(toks) > self._n:
            cur = QTextCursor(self.view.document())
            cur.movePosition(QTextCursor.MoveOperation.End)
            for i in range(self._n, len(toks)):
                t = toks[i]
                f = QTextCharFormat(self._fmt.get(t.kind, self._fmt["target"]))
                f.setProperty(TOKEN_PROP, i)
                if i == P and P:
                    cur.insertText("  \u2503  ", QTextCharFormat())   # prompt | output separator
                cur.insertText(visible(self.pieces(t.id)), f)
                if i >= P:
                    self._kinds[t.kind] = self._kinds.get(t.kind, 0) + 1
            self._n = len(toks)
            sb = self.view.verticalScrollBar()
            sb.setValue(sb.maximum())
        if state.request_id >= 0:
            end = state.end
            status = f"done ({end.stopped})" if end else ("running" if state.running and state.shown.active else "")
            t = state.turn
            turn = (f"Conversation {t.conversation}, turn {t.turn} (the prompt is the whole conversation) · "
                    if t is not None and t.request_id == state.request_id else "")
            self.title.setText(f"{turn}Request {state.request_id} · policy {state.policy} · prompt {P} tokens · "
                               f"generated {state.generated}{self._drafts_text()} · {status}")

    def _drafts_text(self) -> str:
        """The coloured output tokens that did not come from a plain target step, counted."""
        d, c = self._kinds.get(DRAFT, 0), self._kinds.get(COPY, 0)
        parts = ([f"{d} accepted draft"] if d else []) + ([f"{c} gate copies"] if c else [])
        return f" ({', '.join(parts)})" if parts else ""

    # ------------------------------------------------------------------ hover
    def tooltip(self, idx: int) -> str:
        st = self.state
        if st is None or not (0 <= idx < len(st.tokens)):
            return ""
        t: Tok = st.tokens[idx]
        head = f"{PROVENANCE_LABELS.get(t.kind, t.kind)} · id {t.id} · {self.pieces(t.id)!r}"
        if t.round < 0:
            c = st.cache
            if t.kind == "reused":
                why = f"KV cloned from the prefix cache (hit q={c.hit_tokens} of P={c.prompt_tokens})"
            elif t.kind == "boundary":
                why = (f"partial hit q={c.hit_tokens}: positions 0..{c.reused_tokens - 1} cloned, "
                       f"this token recomputed by the target")
            else:
                why = f"prefilled by the target ({c.prefill_ms:.1f} ms for the non-reused part)"
            return f"{head}\nprompt position {t.pos}\n{why}"
        r = st.rounds_by_index.get(t.round)
        if r is None:
            return f"{head}\nround {t.round}, k={t.k}"
        lines = [head, f"output token {t.pos - st.prompt_tokens + 1} · round {r.index} ({r.kind}, k={r.k})"]
        if r.kind == "prefill":
            lines.append(f"first token after prefill · TTFT {r.round_ms:.1f} ms")
        elif is_copy_round(r):
            lines.append(f"gate copy round: {r.drafted} n-gram tokens copied and verified, {r.accepted} accepted "
                         f"(k={r.k}{': no model draft' if r.k == 0 else ''}; not the draft's acceptance) · "
                         f"alpha EWMA {r.alpha:.2f}")
            lines.append(f"lookup {r.draft_ms:.1f} ms · verify {r.verify_ms:.1f} ms · round {r.round_ms:.1f} ms")
        else:
            lines.append(f"drafted {r.drafted}, accepted {r.accepted} · alpha EWMA {r.alpha:.2f}")
            lines.append(f"draft {r.draft_ms:.1f} ms · verify {r.verify_ms:.1f} ms · round {r.round_ms:.1f} ms"
                         + (f" · catch-up {r.catchup_tokens} tok" if r.catchup_tokens else ""))
        lines.append(f"t = {r.t:.3f} s · context {r.context}")
        return "\n".join(lines)

    def snapshot(self) -> dict:
        return {"text": self.view.toPlainText(), "title": self.title.text(), "n": self._n,
                "kinds": dict(self._kinds)}
