"""Attach the explorer to a running ``rakv serve`` (read-only).

A ``Poller`` on its own QThread long-polls the server's ``GET /rakv/records?since=N`` and sends the
records it gets, as rakv record objects, with their tokens' text pieces, to the GUI thread by a
queued signal. The ``Attachment`` applies them to a ``SessionState`` of its own, which the window
shows through the same panels as a live run or a replay (``window.state``). Nothing is sent to the
server but the polls: the explorer watches the requests other tools send.

If the first poll fails, nothing is attached (a dialog says why). A server that goes away later is
polled again every ``RETRY_S`` seconds (the status bar says so); a restarted server (another
``server`` id) starts a fresh state.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.pieces import Pieces
from app.state import SessionState

WAIT_S = 1.0          # the long-poll's wait (also how soon a detach ends the poller)
RETRY_S = 2.0         # between polls of a server that went away
TIMEOUT_S = 5.0


def fetch_records(url: str, since: int, wait: float = WAIT_S, timeout: float = TIMEOUT_S) -> dict:
    """One poll: the server's answer to GET /rakv/records (OSError / ValueError on failure)."""
    with urllib.request.urlopen(f"{url}/rakv/records?since={int(since)}&wait={wait:g}", timeout=timeout) as r:
        data = json.loads(r.read().decode("utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("records"), list) or not isinstance(data.get("next"), int):
        raise ValueError("the answer is not a rakv server's records (is this a `rakv serve`?)")
    return data


def records_of(dicts: list) -> list:
    """Record objects from the server's dicts (a record of a type this explorer does not know is skipped)."""
    from rakv.records import RecordingError, from_dict

    out = []
    for d in dicts:
        try:
            rec = from_dict(d)
        except (RecordingError, TypeError):
            continue
        if not hasattr(rec, "predicted_ms") and isinstance(d.get("predicted_ms"), (int, float)):
            rec.predicted_ms = d["predicted_ms"]     # a step's predicted cost, from a server newer than this schema
        out.append(rec)
    return out


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


class Poller(QObject):
    """Lives on the attachment's thread; ``run`` polls until ``stop``."""

    batch = Signal(object, object)   # records, {token id: text piece} (int keys: not a QVariantMap)
    connected = Signal(dict)       # the first answer: {"model": ..., "server": ...}
    reset = Signal()               # another server answers now (restarted): start a fresh state
    lost = Signal(str)             # a poll failed after the server had answered
    failed = Signal(str)           # the first poll failed: nothing attached

    def __init__(self, url: str):
        super().__init__()
        self.url = url
        self.since = 0
        self.server = None
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @Slot()
    def run(self) -> None:
        answered = down = False
        while not self._stop.is_set():
            try:
                data = fetch_records(self.url, self.since)
            except (OSError, ValueError) as e:
                if not answered:
                    self.failed.emit(f"cannot reach {self.url}: {_reason(e)}")
                    return
                if not down:
                    self.lost.emit(_reason(e))
                    down = True
                self._stop.wait(RETRY_S)
                continue
            down = False
            if not answered:
                answered = True
                self.server = data.get("server")
                self.connected.emit({"model": data.get("model", ""), "server": self.server})
            elif data.get("server") != self.server:        # restarted: its records number from 0 again
                self.server, self.since = data.get("server"), 0
                self.reset.emit()
                self.connected.emit({"model": data.get("model", ""), "server": self.server})
                continue
            self.since = data["next"]
            recs = records_of(data["records"])
            if recs:
                pieces = {int(k): str(v) for k, v in (data.get("pieces") or {}).items()}
                self.batch.emit(recs, pieces)


class Attachment(QObject):
    """The explorer's side of one attached server: its state and pieces, fed by a Poller."""

    stateReplaced = Signal(object)
    connected = Signal(dict)
    lost = Signal(str)
    failed = Signal(str)
    applied = Signal(int)          # records applied so far

    def __init__(self, url: str, parent=None):
        super().__init__(parent)
        self.url = url
        self.state = SessionState()
        self.pieces = Pieces()
        self.count = 0
        self.thread_ = QThread(self)
        self.thread_.setObjectName("rakv-attach")
        self.poller = Poller(url)
        self.poller.moveToThread(self.thread_)
        self.thread_.started.connect(self.poller.run)
        self.poller.batch.connect(self._apply)
        self.poller.reset.connect(self._reset)
        self.poller.connected.connect(self.connected)
        self.poller.lost.connect(self.lost)
        self.poller.failed.connect(self.failed)

    def start(self) -> None:
        self.thread_.start()

    def stop(self) -> None:
        self.poller.stop()
        self.thread_.quit()
        self.thread_.wait(int((WAIT_S + TIMEOUT_S) * 1000))

    def _apply(self, recs: list, pieces: dict) -> None:
        self.pieces.table.update(pieces)
        self.state.apply_all(recs)
        self.count += len(recs)
        self.applied.emit(self.count)

    def _reset(self) -> None:
        self.state = SessionState()
        self.pieces.table.clear()
        self.count = 0
        self.stateReplaced.emit(self.state)


# ----------------------------------------------------------------------------- the window's side
DEFAULT_URL = "http://127.0.0.1:8000"


def attach(win, url: str | None = None) -> bool:
    """Attach ``win`` (a MainWindow) to the server at ``url`` (None: ask for it)."""
    from PySide6.QtWidgets import QInputDialog, QLineEdit

    from rakv.serve.api import server_url

    if url is None:
        last = getattr(win, "_attach_url", DEFAULT_URL)
        url, ok = QInputDialog.getText(win, "Attach to server",
                                       "Address of a running `rakv serve` (its requests are shown live, read-only):",
                                       QLineEdit.EchoMode.Normal, last)
        if not ok:
            return False
    try:
        url = server_url(url)
    except ValueError as e:
        win.show_error("Cannot attach to server", str(e))
        return False
    detach(win)
    if win.replayer is not None:
        win.leave_replay()
    win._attach_url = url
    att = Attachment(url, win)
    att.failed.connect(lambda msg: (detach(win), win.show_error("Cannot attach to server", msg)))
    att.lost.connect(lambda msg: win.msg.setText(f"lost the server at {url} ({msg}); trying again ..."))
    att.connected.connect(lambda info: _connected(win, url, info))
    att.stateReplaced.connect(lambda st: setattr(win, "state", st) if win.attachment is att else None)
    win.attachment = att
    win._loaded_text = win.run_panel.loaded.text()
    win.state = att.state
    win.tokens.pieces = att.pieces
    win.setWindowTitle(f"RAKV Explorer — attached to {url}")
    win.act_detach.setEnabled(True)
    win.msg.setText(f"attaching to {url} ...")
    att.start()
    return True


def detach(win) -> None:
    """Stop watching the attached server; the window shows its own session again."""
    att = getattr(win, "attachment", None)
    if att is None:
        return
    win.attachment = None
    att.stop()
    att.deleteLater()
    win.state = win.live
    win.tokens.pieces = win.live_pieces
    win.setWindowTitle("RAKV Explorer")
    win.act_detach.setEnabled(False)
    win.run_panel.set_loaded(getattr(win, "_loaded_text", "") or "no models loaded")
    win.msg.setText(f"detached from {att.url}")


def _connected(win, url: str, info: dict) -> None:
    what = f"attached to {url} ({info.get('model') or 'a rakv server'}): its requests show here as they run"
    win.msg.setText(what + " (read-only)")
    win.run_panel.set_loaded(what + "; File > Detach from server returns to this window's own models")
