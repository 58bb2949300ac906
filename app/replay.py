"""Replays a recording through a fresh ``SessionState`` (play, pause, step, speed, seek).

Records are applied at their recorded times (idle gaps between requests are capped at
``GAP_CAP`` seconds) scaled by the speed; ``speed = 0`` means as fast as the redraw allows.
"""

from __future__ import annotations

import math
import time

from PySide6.QtCore import QObject, QTimer, Signal

from app.state import SessionState

GAP_CAP = 0.5
TICK_MS = 20
MAX_PER_TICK = 400


def check_replayable(recs) -> None:
    """Apply a recording to a scratch state once; a record that cannot be shown is a RecordingError
    naming its file:line (not an "Unexpected error" halfway through the replay)."""
    from rakv.records import RecordingError

    st = SessionState()
    for i, r in enumerate(recs):
        try:
            st.apply(r)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            where = recs.where(i) if hasattr(recs, "where") else f"record {i + 1}"
            raise RecordingError(f"{where}: cannot replay this {r.type} record ({type(e).__name__}: {e})") from None


class Replayer(QObject):
    positionChanged = Signal(int)
    playingChanged = Signal(bool)
    finished = Signal()
    stateReplaced = Signal(object)

    def __init__(self, records: list, path: str = "", parent=None):
        super().__init__(parent)
        self.records = records
        self.path = path
        self.play_t = []
        acc, prev = 0.0, None
        for r in records:
            t = float(getattr(r, "t", 0.0) or 0.0)
            if not math.isfinite(t):          # a damaged time (NaN, inf) would stall the play clock
                t = prev if prev is not None else 0.0
            if prev is not None:
                acc += min(max(0.0, t - prev), GAP_CAP)
            self.play_t.append(acc)
            prev = t
        self.pos = 0
        self.clock = 0.0
        self.speed = 1.0
        self.state = SessionState()
        self.timer = QTimer(self)
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(self._tick)
        self._last = 0.0

    @property
    def total(self) -> int:
        return len(self.records)

    @property
    def duration(self) -> float:
        return self.play_t[-1] if self.play_t else 0.0

    def playing(self) -> bool:
        return self.timer.isActive()

    # ------------------------------------------------------------------ controls
    def play(self) -> None:
        if self.pos >= self.total:
            self.seek(0)
        self._last = time.perf_counter()
        self.timer.start()
        self.playingChanged.emit(True)

    def pause(self) -> None:
        self.timer.stop()
        self.playingChanged.emit(False)

    def toggle(self) -> None:
        self.pause() if self.playing() else self.play()

    def set_speed(self, speed: float) -> None:
        self.speed = max(0.0, float(speed))

    def step(self) -> None:
        self.pause()
        if self.pos < self.total:
            self._apply_to(self.pos + 1)

    def seek(self, n: int) -> None:
        n = max(0, min(self.total, int(n)))
        if n < self.pos:
            self.state = SessionState()
            self.pos = 0
            self.stateReplaced.emit(self.state)
        self._apply_to(n)

    def finish(self) -> None:
        """Apply everything now (scripted mode)."""
        self._apply_to(self.total)

    # ------------------------------------------------------------------ internals
    def _apply_to(self, n: int) -> None:
        if n > self.pos:
            self.state.apply_all(self.records[self.pos:n])
            self.pos = n
        self.clock = self.play_t[n - 1] if n > 0 else 0.0
        self.positionChanged.emit(self.pos)
        if self.pos >= self.total:
            if self.timer.isActive():
                self.timer.stop()
                self.playingChanged.emit(False)
            self.finished.emit()

    def _tick(self) -> None:
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        if self.speed <= 0:
            self._apply_to(min(self.total, self.pos + MAX_PER_TICK))
            return
        clock = self.clock + dt * self.speed
        n = self.pos
        while n < self.total and self.play_t[n] <= clock and n - self.pos < MAX_PER_TICK:
            n += 1
        if n > self.pos:
            self._apply_to(n)
        self.clock = clock
