"""Watch a vLLM server (read-only): its /metrics polled, its speculation and prefix cache shown.

A ``VllmPoller`` on its own QThread sends ``GET <url>/metrics`` every ``POLL_S`` seconds, turns
each answer into a ``rakv.integrations.vllm_watch.WatchRecord`` (plain frozen data) and sends it to
the GUI thread by a queued signal. The ``VllmWatcher`` keeps them in a ``VllmWatchState`` that the
window's *vLLM server* panel (app/panels/vllm.py) draws on the ~25 Hz redraw timer: acceptance per
position, alpha per token against the crossover alpha*(k) of a vLLM cost profile (``rakv calibrate
--engine vllm``), the prefix-cache hit rate and the counters.

Nothing but GETs of /metrics is sent: the explorer does not steer a server it does not own. If the
first poll fails (or the answer has no ``vllm:`` metrics), nothing is watched and a dialog says why
in one line. A server that goes away later is polled again every ``POLL_S`` (the status bar says
so); one whose counters went down (restarted) starts fresh series.
"""

from __future__ import annotations

import threading
import time
import urllib.error

from PySide6.QtCore import QObject, QThread, Signal, Slot

from rakv.integrations.vllm_watch import Crossover, Watch, WatchRecord, crossover, fetch, metrics_url

POLL_S = 1.0            # between polls (also how soon a detach ends the poller)
TIMEOUT_S = 5.0
MAX_POINTS = 3600       # the series keep the last hour at one poll a second
DEFAULT_URL = "http://127.0.0.1:8000"


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


class VllmPoller(QObject):
    """Lives on the watcher's thread; ``run`` polls until ``stop``."""

    record = Signal(object)        # a WatchRecord
    lost = Signal(str)             # a poll failed after the server had answered
    back = Signal()                # it answers again
    failed = Signal(str)           # the first poll failed: nothing watched

    def __init__(self, url: str, interval: float | None = None):
        super().__init__()
        self.url = url
        self.interval = POLL_S if interval is None else interval
        self.watch = Watch()
        self._stop = threading.Event()
        self._t0 = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    @Slot()
    def run(self) -> None:
        answered = down = False
        while not self._stop.is_set():
            try:
                rec = self.watch.update(fetch(self.url, TIMEOUT_S), time.monotonic() - self._t0)
            except (OSError, ValueError) as e:
                if not answered:
                    self.failed.emit(f"cannot watch {self.url}: {_reason(e)}")
                    return
                if not down:
                    down = True
                    self.lost.emit(_reason(e))
            else:
                answered = True
                if down:
                    down = False
                    self.back.emit()
                self.record.emit(rec)
            self._stop.wait(self.interval)


class VllmWatchState:
    """What the panel draws: the records since the server (re)started, the latest, the profile."""

    def __init__(self, url: str):
        self.url = url
        self.records: list[WatchRecord] = []
        self.latest: WatchRecord | None = None
        self.crossover: Crossover | None = None
        self.status = f"watching {url} ..."
        self.down = False
        self.version = 0

    def apply(self, rec: WatchRecord) -> None:
        if rec.restarted:
            self.records = []
        self.records.append(rec)
        del self.records[:-MAX_POINTS]
        self.latest = rec
        self.down = False
        self.version += 1

    def set_status(self, text: str, down: bool | None = None) -> None:
        self.status = text
        if down is not None:
            self.down = down
        self.version += 1

    def set_crossover(self, c: Crossover | None) -> None:
        self.crossover = c
        self.version += 1


class VllmWatcher(QObject):
    """The explorer's side of one watched vLLM server, fed by a VllmPoller."""

    failed = Signal(str)
    applied = Signal(object)       # each WatchRecord, after it is in the state
    lost = Signal(str)
    back = Signal()

    def __init__(self, url: str, parent=None, interval: float | None = None):
        super().__init__(parent)
        self.url = url
        self.state = VllmWatchState(url)
        self.thread_ = QThread(self)
        self.thread_.setObjectName("rakv-vllm-watch")
        self.poller = VllmPoller(url, interval)
        self.poller.moveToThread(self.thread_)
        self.thread_.started.connect(self.poller.run)
        self.poller.record.connect(self._apply)
        self.poller.lost.connect(self._lost)
        self.poller.back.connect(self._back)
        self.poller.failed.connect(self.failed)

    def start(self) -> None:
        self.thread_.start()

    def stop(self) -> None:
        self.poller.stop()
        self.thread_.quit()
        self.thread_.wait(int((self.poller.interval + TIMEOUT_S + 1) * 1000))

    def _apply(self, rec: WatchRecord) -> None:
        self.state.apply(rec)
        self.applied.emit(rec)

    def _lost(self, why: str) -> None:
        self.state.set_status(f"lost the vLLM server at {self.url} ({why}); trying again every "
                              f"{self.poller.interval:g} s ...", down=True)
        self.lost.emit(why)

    def _back(self) -> None:
        self.state.set_status(f"the vLLM server at {self.url} answers again", down=False)
        self.back.emit()


# ----------------------------------------------------------------------------- the window's side
def panel(win):
    """The window's *vLLM server* dock and panel (made on first use, tabbed with *Acceptance*)."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QDockWidget

    from app.panels.vllm import VllmPanel

    if getattr(win, "vllm_panel", None) is not None:
        return win.vllm_panel
    p = VllmPanel()
    p.profileRequested.connect(lambda: choose_profile(win))
    p.detachRequested.connect(lambda: unwatch(win))
    d = QDockWidget("vLLM server", win)
    d.setObjectName("dock_vllm")
    d.setWidget(p)
    d.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                  | QDockWidget.DockWidgetFeature.DockWidgetClosable
                  | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
    if not win.restoreDockWidget(d):          # where the last session's layout had it, else beside Acceptance
        win.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, d)
        win.tabifyDockWidget(win.docks["acceptance"], d)
        W, H = max(800, win.width()), max(500, win.height())      # room for its three plots
        win.resizeDocks([win.docks["acceptance"], win.docks["timeline"]], [int(W * 0.45), int(W * 0.2)],
                        Qt.Orientation.Horizontal)
        win.resizeDocks([win.docks["acceptance"]], [int(H * 0.5)], Qt.Orientation.Vertical)
    win.view_menu.addAction(d.toggleViewAction())
    win.vllm_panel, win.vllm_dock = p, d
    return p


def watch(win, url: str | None = None, profile: str | None = None, interval: float | None = None) -> bool:
    """Watch the vLLM server at ``url`` (None: ask, offering the last one). ``profile``: a vLLM cost
    profile for the crossover (None: the remembered one if it still exists, else ask when the URL
    was asked for; "": none)."""
    from PySide6.QtWidgets import QInputDialog, QLineEdit

    asked = url is None
    if asked:
        url, ok = QInputDialog.getText(win, "Watch a vLLM server",
                                       "Address of a running vLLM server (its /metrics is polled once a second, "
                                       "read-only):", QLineEdit.EchoMode.Normal,
                                       win.settings.vllm_url() or DEFAULT_URL)
        if not ok:
            return False
    try:
        murl = metrics_url(url)
    except ValueError as e:
        win.show_error("Cannot watch the vLLM server", str(e))
        return False
    unwatch(win, quiet=True)
    win.settings.set_vllm_url(url.strip())
    w = VllmWatcher(murl, win, interval)
    win.vwatch = w
    p = panel(win)
    p.show_state(w.state)
    if profile is None:
        remembered = win.settings.vllm_profile()
        profile = remembered if remembered and _exists(remembered) else (None if asked else "")
    if profile is None:
        choose_profile(win)
    elif profile:
        choose_profile(win, profile)
    w.failed.connect(lambda msg, w=w: _failed(win, w, msg))
    w.lost.connect(lambda why: win.msg.setText(w.state.status))
    w.back.connect(lambda: win.msg.setText(w.state.status))
    w.applied.connect(lambda rec: _applied(win, w, rec))
    win.act_vllm_detach.setEnabled(True)
    win.vllm_dock.show()
    win.vllm_dock.raise_()
    win.msg.setText(f"watching the vLLM server at {murl} ...")
    w.start()
    return True


def _exists(path: str) -> bool:
    from pathlib import Path

    return Path(path).is_file()


def _failed(win, w: VllmWatcher, msg: str) -> None:
    if win.vwatch is w:
        unwatch(win, quiet=True)
    win.show_error("Cannot watch the vLLM server", msg)


def _applied(win, w: VllmWatcher, rec: WatchRecord) -> None:
    if win.vwatch is not w:
        return
    if rec.poll == 1:
        models = ", ".join(rec.total.models) or "a vLLM server"
        win.msg.setText(f"watching the vLLM server at {w.url} ({models}), read-only")
        w.state.set_status(f"watching {w.url} ({models}), read-only")
        if win.vllm_dock is not None and not win.vllm_dock.isFloating():
            win.vllm_dock.raise_()               # its tab in front (a restored layout may have put another there)
    elif rec.restarted:
        text = f"the vLLM server at {w.url} restarted (its counters went down): its series start again"
        win.msg.setText(text)
        w.state.set_status(text)
    cx = w.state.crossover
    if cx is not None and rec.total.k and str(rec.total.k) not in cx.alpha_star:
        try:                                   # the server drafts more than the profile's k_max: extend it
            w.state.set_crossover(crossover(cx.path, rec.total.k))
        except ValueError:
            pass


def choose_profile(win, path: str | None = None) -> bool:
    """Load a vLLM cost profile (None: a file dialog) for the crossover lines; remembered."""
    from PySide6.QtWidgets import QFileDialog

    w = win.vwatch
    if path is None:
        start = win.settings.vllm_profile() or "vllm-profile.json"
        path, _ = QFileDialog.getOpenFileName(win, "vLLM cost profile (rakv calibrate --engine vllm)", start,
                                              "JSON (*.json);;All files (*)")
        if not path:
            return False
    k = w.state.latest.total.k if w is not None and w.state.latest is not None else 0
    try:
        cx = crossover(path, max(8, k))
    except ValueError as e:
        win.show_error("Cannot use the cost profile", str(e))
        return False
    win.settings.set_vllm_profile(str(path))
    if w is not None:
        w.state.set_crossover(cx)
    return True


def unwatch(win, quiet: bool = False) -> None:
    """Stop polling the watched vLLM server (its last numbers stay in the panel)."""
    w = getattr(win, "vwatch", None)
    if w is None:
        return
    win.vwatch = None
    w.stop()
    w.state.set_status(f"detached from {w.url} (the last numbers polled)")
    w.deleteLater()
    win.act_vllm_detach.setEnabled(False)
    if not quiet:
        win.msg.setText(f"detached from the vLLM server at {w.url}")


def refresh(win) -> None:
    """On the redraw timer: the vLLM panel, where there is one."""
    p = getattr(win, "vllm_panel", None)
    if p is not None:
        p.refresh()
