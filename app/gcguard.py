"""Python's cyclic garbage collector run from the GUI thread only, while a window lives.

An automatic collection starts in whichever thread happens to allocate past the threshold; while
a run is going that is mostly the engine's worker thread, and a collection there finalizes Qt
objects that wait in reference cycles (a context menu, a dialog's wrappers) off the GUI thread,
taking Qt's locks from the wrong thread: a run of the GUI tests hung there once. So while a
window lives automatic collection is off, and a timer on the GUI thread collects each generation
when its count passes the threshold the automatic collector would have used (the usual recipe for
threaded Qt programs). Reference counting frees everything not in a cycle as before.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 500          # how often the GUI thread looks at the collector's counts

_holders = 0               # guards started and not stopped (automatic collection is off while > 0)
_was_enabled = True        # the collector's state when the first guard started (the last one restores it)


class GuiThreadGC(QObject):
    """Turns automatic collection off until ``stop()``; collects from its timer meanwhile."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = INTERVAL_MS):
        super().__init__(parent)
        global _holders, _was_enabled
        self.threshold = gc.get_threshold()
        self.running = True
        if _holders == 0:
            _was_enabled = gc.isenabled()
        _holders += 1
        gc.disable()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.check)
        self.timer.start(interval_ms)

    def check(self) -> None:
        """Collect the generations whose counts passed their thresholds, youngest first."""
        c0, c1, c2 = gc.get_count()
        t0, t1, t2 = self.threshold
        if c0 > t0:
            gc.collect(0)
            if c1 > t1:
                gc.collect(1)
                if c2 > t2:
                    gc.collect(2)

    def stop(self) -> None:
        """Stop the timer; the last guard stopped turns automatic collection back on, if it was on
        before the first (a caller that had it off, the GUI tests, keeps it off)."""
        global _holders
        if not self.running:
            return
        self.running = False
        self.timer.stop()
        _holders = max(0, _holders - 1)
        if _holders == 0 and _was_enabled:
            gc.enable()
