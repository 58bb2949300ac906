"""Event-loop lag probe: a 10 ms precise timer; lag = how late each tick fires.

Samples taken while ``active`` (a run in progress) are kept apart, so the report says how
responsive the GUI stayed during runs."""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, Qt, QTimer

INTERVAL_MS = 10


class LagProbe(QObject):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.active = False
        self.samples_active: list[float] = []
        self.samples_all_max = 0.0
        self.timer = QTimer(self)
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(INTERVAL_MS)
        self.timer.timeout.connect(self._tick)
        self._last = None

    def start(self) -> None:
        self._last = time.perf_counter()
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            lag = max(0.0, (now - self._last) * 1e3 - INTERVAL_MS)
            self.samples_all_max = max(self.samples_all_max, lag)
            if self.active:
                self.samples_active.append(lag)
                if len(self.samples_active) > 200_000:
                    del self.samples_active[:100_000]
        self._last = now

    def stats(self) -> tuple[float, float, int]:
        """(max ms, p99 ms, samples) over the ticks taken during runs."""
        xs = sorted(self.samples_active)
        if not xs:
            return 0.0, 0.0, 0
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return xs[-1], p99, len(xs)

    def report(self) -> str:
        mx, p99, n = self.stats()
        return f"event-loop lag max {mx:.1f} ms p99 {p99:.1f} ms ({n} samples during runs)"
