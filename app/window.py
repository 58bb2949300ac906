"""The main window: panels in docks around the token stream, menus, status bar, worker wiring."""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from PySide6.QtCore import QThread, QTimer, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QLabel, QMainWindow, QMessageBox,
                               QProgressBar, QProgressDialog, QSizePolicy, QTabWidget, QToolBar)

from app import exports, icons, layout
from app.gcguard import GuiThreadGC
from app.lagprobe import LagProbe
from app.panels import batch
from app.panels.acceptance import AcceptancePanel
from app.panels.cache import CachePanel
from app.panels.chat import ChatPanel
from app.panels.controls import ControlsPanel
from app.panels.costs import CostsPanel
from app.panels.replay import ReplayBar
from app.panels.run import RunPanel
from app.panels.timeline import TimelinePanel
from app.panels.tokens import TokenPanel
from app.panels.tree import TreePanel
from app.pieces import Pieces, load_pieces
from app.replay import Replayer, check_replayable
from app.settings import Settings, sampling_from_text, sessions_dir
from app.state import SessionState
from app.worker import Worker
from rakv.config import parse_k_set

REDRAW_MS = 40          # ~25 Hz


class MainWindow(QMainWindow):
    # commands to the worker (queued: the worker lives on its own thread)
    _load = Signal(str, str, int)
    _use = Signal(object)
    _run = Signal(str, str, int)
    _chat = Signal(str, str, int)
    _new_conv = Signal()
    _budget = Signal(float)
    _measure = Signal(str, int, int)
    _recalibrate = Signal(bool)
    # notifications (tests and scripted mode)
    runFinished = Signal(object)
    measureFinished = Signal(object)     # OracleResult, or None (cancelled / error)
    modelsLoaded = Signal(dict)
    replayFinished = Signal()
    errorShown = Signal(str)

    def __init__(self, settings: Settings | None = None, sessions: Path | None = None):
        super().__init__()
        self.gc_guard = GuiThreadGC(self)     # cyclic garbage collected on this thread only (app/gcguard.py)
        self.settings = settings or Settings()
        self.setWindowTitle("RAKV Explorer")
        self.setWindowIcon(icons.icon("app"))
        self.live = SessionState()
        self.state = self.live
        self.replayer: Replayer | None = None
        self.attachment = None               # an attached `rakv serve` (app/attach.py), shown read-only
        self.vwatch = None                   # a watched vLLM server (app/vllm_watch.py), read-only
        self.vllm_panel = None               # its panel and dock, made on first use
        self.vllm_dock = None
        self.running = False
        self.measuring = False
        self.measure_dialog: QProgressDialog | None = None
        self.busy = ""
        self.loaded_pair: tuple[str, str] | None = None
        self.preloaded = False
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.live_pieces = Pieces()
        self._drawn = None
        self.redraw_ms_max = 0.0             # slowest redraw so far (reported with the lag)
        self._build_panels()
        self._build_menus()
        self._build_status()
        self._start_worker(sessions if sessions is not None else sessions_dir())
        self._restore()
        self.redraw_timer = QTimer(self)
        self.redraw_timer.setInterval(REDRAW_MS)
        self.redraw_timer.timeout.connect(lambda: self.redraw(full=False))
        self.redraw_timer.start()
        self.lag = LagProbe(self)
        self.lag.start()

    # ------------------------------------------------------------------ construction
    def _build_panels(self) -> None:
        self.tokens = TokenPanel(self.live_pieces)
        self.chat = ChatPanel(lambda: self.tokens.pieces)
        self.chat.copyRequested.connect(self.copy_answer)
        self.chat.exportRequested.connect(lambda: self.export_conversation())
        self.central = QTabWidget()        # the chat transcript and the token stream (provenance colours)
        self.central.setDocumentMode(True)
        self.central.addTab(self.chat, "Chat")
        self.central.addTab(self.tokens, "Token stream")
        self.central.currentChanged.connect(lambda _: self.chat.refresh(self.state))
        self.setCentralWidget(self.central)
        self.run_panel = RunPanel()
        self.controls = ControlsPanel()
        self.cache = CachePanel()
        self.costs = CostsPanel()
        self.acceptance = AcceptancePanel()
        self.timeline = TimelinePanel()
        self.tree = TreePanel(lambda: self.tokens.pieces)
        self.plots = [self.cache, self.costs, self.acceptance, self.timeline, self.tree]
        self._tree_shown = None                  # the state whose first tree raised the Token tree tab
        self._plot_drawn: dict[int, tuple] = {}
        self._rr = 0
        self.docks: dict[str, QDockWidget] = {}
        L, R, B = (Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea,
                   Qt.DockWidgetArea.BottomDockWidgetArea)
        for name, title, w, area in (("run", "Models and prompt", self.run_panel, L),
                                     ("controls", "Live controls", self.controls, L),
                                     ("cache", "Prefix cache", self.cache, R),
                                     ("costs", "Action costs", self.costs, R),
                                     ("acceptance", "Acceptance", self.acceptance, B),
                                     ("timeline", "Round timeline", self._rounds_tabs(), B)):
            d = QDockWidget(title, self)
            d.setObjectName(f"dock_{name}")
            if name in ("run", "controls", "cache"):   # forms: they scroll down rather than push the window past
                w = layout.FormScroll(w)               # the screen or overlap, never sideways (app/layout.py)
            d.setWidget(w)
            d.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                          | QDockWidget.DockWidgetFeature.DockWidgetClosable
                          | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
            self.addDockWidget(area, d)
            self.docks[name] = d
        self.splitDockWidget(self.docks["acceptance"], self.docks["timeline"], Qt.Orientation.Horizontal)
        self.batch = batch.install(self)           # requests decoding together (a tab beside the prefix cache)
        self.setCorner(Qt.Corner.BottomLeftCorner, L)
        self.setCorner(Qt.Corner.BottomRightCorner, R)
        self.replay_bar = ReplayBar()
        self.replay_tb = QToolBar("Replay")
        self.replay_tb.setObjectName("toolbar_replay")
        self.replay_tb.setMovable(False)
        self.replay_tb.addWidget(self.replay_bar)
        self.replay_tb.hide()

        self.run_panel.runRequested.connect(self.run)
        self.run_panel.stopRequested.connect(self.stop)
        self.run_panel.measureRequested.connect(self.measure_all)
        self.run_panel.loadRequested.connect(self.load_models)
        self.run_panel.newConversationRequested.connect(self.new_conversation)
        self.controls.budgetChanged.connect(self._budget_changed)
        self.controls.kSetChanged.connect(lambda ks: self.worker.set_controls(k_set=ks))
        self.controls.forceChanged.connect(lambda f: self.worker.set_controls(force=f))
        self.controls.granularityChanged.connect(lambda g: self.worker.set_controls(granularity=g))
        self.controls.samplingChanged.connect(lambda smp: self.worker.set_controls(sampling=smp))
        self.run_panel.raw.toggled.connect(lambda on: self.worker.set_controls(chat_template=not on))
        self.replay_bar.closeRequested.connect(self.leave_replay)

    def _rounds_tabs(self) -> QTabWidget:
        """The bottom-right dock: the round timeline and the token tree, as tabs (the dock's title
        follows the tab)."""
        self.rounds_tabs = QTabWidget()
        self.rounds_tabs.setDocumentMode(True)
        self.rounds_tabs.setTabPosition(QTabWidget.TabPosition.South)
        self.rounds_tabs.addTab(self.timeline, "Round timeline")
        self.rounds_tabs.addTab(self.tree, "Token tree")
        self.rounds_tabs.currentChanged.connect(
            lambda i: self.docks["timeline"].setWindowTitle(self.rounds_tabs.tabText(i)))
        return self.rounds_tabs

    def _action(self, text, slot, shortcut=None, icon=None) -> QAction:
        a = QAction(text, self)
        if shortcut:
            a.setShortcut(QKeySequence(shortcut))
        if icon:
            a.setIcon(icons.icon(icon))
        a.triggered.connect(slot)
        return a

    def _build_menus(self) -> None:
        mb = self.menuBar()
        f = mb.addMenu("&File")
        self.act_open = self._action("&Open recording ...", lambda: self.open_recording(), QKeySequence.StandardKey.Open, "open")
        self.recent_menu = f.addMenu("Open &recent")
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        f.insertAction(self.recent_menu.menuAction(), self.act_open)
        self.act_export = self._action("&Export session timings (CSV) ...", lambda: self.export_csv(), "Ctrl+E", "export")
        f.addAction(self.act_export)
        f.addAction(self._action("Export &plots (PNG) ...", lambda: self.export_plots()))
        self.act_export_chat = self._action("Export &conversation (Markdown, JSON) ...",
                                            lambda: self.export_conversation(), "Ctrl+Shift+E")
        f.addAction(self.act_export_chat)
        self.act_copy_answer = self._action("Copy &answer", self.copy_answer, "Ctrl+Shift+C")
        f.addAction(self.act_copy_answer)
        f.addAction(self._action("Show &sessions folder", self._show_sessions))
        self.act_reset_settings = self._action("Reset settings", self.reset_settings)
        self.act_reset_settings.setToolTip("put the models, prompt, policy, max new tokens and live controls "
                                           "back to their defaults")
        f.addAction(self.act_reset_settings)
        f.addSeparator()
        f.addAction(self._action("&Attach to server ...", lambda: self.attach_server()))
        self.act_detach = self._action("&Detach from server", self.detach_server)
        self.act_detach.setEnabled(False)
        f.addAction(self.act_detach)
        self.act_vllm_watch = self._action("&Watch a vLLM server ...", lambda: self.watch_vllm(), "Ctrl+Shift+W")
        self.act_vllm_watch.setToolTip("poll a vLLM server's /metrics (read-only): acceptance per position, "
                                       "alpha against the crossover alpha*(k) of a cost profile, prefix-cache hit rate")
        f.addAction(self.act_vllm_watch)
        self.act_vllm_detach = self._action("Detach from the v&LLM server", lambda: self.unwatch_vllm())
        self.act_vllm_detach.setEnabled(False)
        f.addAction(self.act_vllm_detach)
        f.addSeparator()
        f.addAction(self._action("&Quit", self.close, QKeySequence.StandardKey.Quit))
        r = mb.addMenu("&Run")
        self.act_run = self._action("&Run", self.run, "Ctrl+R", "run")
        self.act_stop = self._action("&Stop", self.stop, "Esc", "stop")
        self.act_stop.setEnabled(False)
        self.act_measure = self._action("&Measure every action", self.measure_all, "Ctrl+M", "measure")
        self.act_measure.setToolTip("run every (r, k) of {0,1} x K on the prompt from the same cache state, "
                                    "R times each: measured cost beside each prediction, the oracle, the regret")
        r.addAction(self.act_run)
        r.addAction(self.act_stop)
        r.addAction(self.act_measure)
        r.addAction(self._action("&Load models", lambda: self.load_models(*self.run_panel.pair())))
        self.act_recalibrate = self._action("Re&calibrate costs", lambda: self.recalibrate())
        self.act_recalibrate.setToolTip("measure the loaded pair's cost profile again (and save it); "
                                        "a new session starts")
        r.addAction(self.act_recalibrate)
        v = self.view_menu = mb.addMenu("&View")
        for d in (*self.docks.values(), self.batch_dock):
            v.addAction(d.toggleViewAction())
        h = mb.addMenu("&Help")
        h.addAction(self._action("&About RAKV Explorer", self.about))
        tb = QToolBar("Main")
        tb.setObjectName("toolbar_main")
        tb.setMovable(False)
        for a in (self.act_run, self.act_stop, self.act_measure, self.act_open, self.act_export):
            tb.addAction(a)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, tb)
        self.addToolBarBreak(Qt.ToolBarArea.TopToolBarArea)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, self.replay_tb)    # its own row, below

    def _build_status(self) -> None:
        sb = self.statusBar()
        self.msg = QLabel("ready")
        # a long message is cut at the right rather than widening the window past the screen
        self.msg.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.msg.setMinimumWidth(160)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(160)
        self.progress.setMaximumHeight(14)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.stats = QLabel("")
        self.lag_label = QLabel("")
        for lab in (self.stats, self.lag_label):      # these too are cut rather than widen the window
            lab.setMinimumWidth(60)
        self.lag_label.setToolTip("event-loop lag during runs (10 ms probe timer): max / p99")
        self.settings_note = QLabel("")       # settings restored with values other than the defaults
        self.settings_note.setTextFormat(Qt.TextFormat.RichText)
        self.settings_note.linkActivated.connect(self._settings_link)
        self.settings_note.hide()
        sb.addWidget(self.msg, 1)
        sb.addWidget(self.settings_note)
        sb.addPermanentWidget(self.progress)
        sb.addPermanentWidget(self.stats)
        sb.addPermanentWidget(self.lag_label)

    def _start_worker(self, sessions: Path) -> None:
        self.thread_ = QThread(self)
        self.thread_.setObjectName("rakv-worker")
        self.worker = Worker(sessions)
        self.worker.moveToThread(self.thread_)
        self._load.connect(self.worker.load_models)
        self._use.connect(self.worker.use_models)
        self._run.connect(self.worker.run)
        self._chat.connect(self.worker.chat)
        self._new_conv.connect(self.worker.new_conversation)
        self._budget.connect(self.worker.set_budget)
        self._measure.connect(self.worker.measure)
        self._recalibrate.connect(self.worker.recalibrate)
        self.worker.measureProgress.connect(self._on_measure_progress)
        self.worker.measured.connect(self._on_measured)
        self.worker.record.connect(self._on_record)
        self.worker.busy.connect(self._on_busy)
        self.worker.progress.connect(self._on_progress)
        self.worker.loaded.connect(self._on_loaded)
        self.worker.finished.connect(self._on_finished)
        self.worker.failed.connect(self._on_failed)
        self.thread_.start()

    def _restore(self) -> None:
        s = self.settings
        rp = self.run_panel
        rp.add_recent(rp.target, s.recent_models("target"))
        rp.add_recent(rp.draft, s.recent_models("draft"))
        self._restored = s.non_defaults()       # shown in the status bar once the window shows
        self.pair_note: tuple[str, str] | None = None    # a restored draft replaced (set_command_line_pair)
        self._note_shown = False
        self._apply_settings()
        geo, st = s.geometry()
        if geo is None or not self.restoreGeometry(geo) or not self._fits_screen():
            self.fit_to_screen()
        if st is not None:
            self.restoreState(st)
        else:
            self.default_docks()
        self.replay_tb.hide()

    def _apply_settings(self) -> None:
        """The stored settings (or their defaults) into the panels and the worker's controls."""
        s = self.settings
        rp = self.run_panel
        rp.set_pair(s.get("models/target"), s.get("models/draft"))
        rp.prompt.setPlainText(s.get("run/prompt"))
        rp.policy.setCurrentText(s.get("run/policy"))
        rp.max_new.setValue(s.get("run/max_new_tokens"))
        rp.raw.setChecked(bool(s.get("run/raw")))
        rp.conversation.setChecked(bool(s.get("run/conversation")))
        self.worker.set_controls(chat_template=not rp.raw.isChecked())
        try:
            ks = parse_k_set(str(s.get("controls/k_set")))
        except ValueError:
            ks = (0, 1, 2, 4, 6, 8)
        gran = s.get("controls/granularity")
        self.controls.set_values(s.get("controls/budget_mib"), ks, gran)
        self.worker.controls.budget_mib = float(self.controls.budget_mib())
        self.worker.set_controls(k_set=self.controls.k_set(), granularity=self.controls.granularity.currentData())
        smp = sampling_from_text(str(s.get("controls/sampling")))
        if smp is not None:
            self.controls.set_sampling(smp)
            self.worker.set_controls(sampling=smp)
        if self.replay_bar.replayer is None:
            i = self.replay_bar.speed.findText(str(s.get("replay/speed")))
            self.replay_bar.speed.setCurrentIndex(i if i >= 0 else 3)

    def showEvent(self, ev) -> None:
        super().showEvent(ev)
        if not self._note_shown:
            self._note_shown = True
            self.show_settings_note()

    def current_settings(self) -> dict:
        """What the panels hold now, as settings (key -> value); save_settings stores these."""
        rp = self.run_panel
        t, d = rp.pair()
        vals = {"models/target": t, "models/draft": d, "run/prompt": rp.prompt_text(),
                "run/policy": rp.policy_text(), "run/max_new_tokens": rp.max_new.value(),
                "run/raw": rp.raw.isChecked(), "run/conversation": rp.conversation.isChecked(),
                "controls/budget_mib": self.controls.budget_mib(),
                "controls/k_set": ",".join(map(str, self.controls.k_set())),
                "controls/granularity": self.controls.granularity.currentData(),
                "replay/speed": self.replay_bar.speed.currentText()}
        smp = self.controls.sampling()
        if not isinstance(smp, str):
            vals["controls/sampling"] = json.dumps(smp.to_dict())
        return vals

    def restored_settings(self) -> list[str]:
        """The settings restored from an earlier session with values other than the defaults, that
        the panels still hold (a command-line flag that replaced one is not listed)."""
        from app.settings import describe, same_value

        now = self.current_settings()
        return [describe(k, v) for k, v in self._restored.items() if k in now and same_value(k, now[k], v)]

    def show_settings_note(self) -> None:
        import html

        items = self.restored_settings()
        if not items and not self.pair_note:
            self.settings_note.hide()
            return
        parts = [html.escape(self.pair_note[0])] if self.pair_note else []
        if items:
            parts += ["restored: " + ", ".join(items), "<a href='reset'>Reset settings</a>"]
        self.settings_note.setText(" · ".join(parts + ["<a href='hide'>×</a>"]))
        self.settings_note.setMinimumWidth(min(self.settings_note.sizeHint().width(), max(240, self.width() // 3)))
        tips = [self.pair_note[1]] if self.pair_note else []
        if items:
            tips.append("these settings differ from the defaults and were restored from the last session; "
                        "File → Reset settings puts every one back to its default")
        self.settings_note.setToolTip("\n".join(tips))
        self.settings_note.show()

    def set_command_line_pair(self, target: str | None, draft: str | None) -> None:
        """``--target`` / ``--draft`` over the restored pair: a restored draft that does not fit the
        named target gives way to the target's default draft, said once (stderr and the status bar)."""
        from app.settings import command_line_pair

        t0, d0 = self.run_panel.pair()
        t, d, note = command_line_pair(target, draft, t0, d0)
        self.run_panel.set_pair(t, d)
        if note:       # (the status bar's short form, the whole line)
            self.pair_note = (f"draft {d} for {t} (not {d0 if len(d0) <= 24 else '…' + d0[-23:]})", note)
            print(f"rakv-explorer: {note}", file=sys.stderr)
            if self._note_shown:
                self.show_settings_note()

    def _settings_link(self, link: str) -> None:
        if link == "reset":
            self.reset_settings()
        else:
            self.settings_note.hide()

    def reset_settings(self) -> None:
        """Every setting back to its default (models, prompt, policy, max new tokens, raw, conversation,
        budget, K, granularity, sampling, replay speed); the window layout and recent lists stay."""
        self.settings.reset()
        self._restored = {}
        self.pair_note = None
        self._apply_settings()
        self._budget.emit(float(self.controls.budget_mib()))
        self.settings_note.hide()
        self.msg.setText("settings reset to their defaults")

    # ------------------------------------------------------------------ window size (app/layout.py)
    def _fits_screen(self) -> bool:
        return layout.fits_screen(self)

    def fit_to_screen(self) -> None:
        layout.fit_to_screen(self)

    def default_docks(self) -> None:
        """The docks' first layout, in proportion to the window (left, right, bottom)."""
        layout.default_docks(self)

    def save_settings(self) -> None:
        s = self.settings
        for k, v in self.current_settings().items():
            s.set(k, v)
        s.save_geometry(self.saveGeometry(), self.saveState())
        s.sync()

    # ------------------------------------------------------------------ commands
    def load_models(self, target: str, draft: str) -> None:
        if self.running or self.busy:
            return
        self.preloaded = False
        self.loaded_pair = None
        self.worker.numerics = self.run_panel.numerics.currentText()      # read by the worker's next load
        self._load.emit(target, draft, max(8, *self.controls.k_set()))
        self._want_pair = (target, draft)

    def use_models(self, target, draft, profile=None) -> None:
        """Install preloaded models (tests, embedding): ``draft`` is a rakv DraftSource."""
        self.preloaded = True
        self._use.emit((target, draft, profile))

    def run(self) -> None:
        if self.running:
            return
        err = self.run_panel.check_policy()
        if err:
            self.show_error("Bad policy", err)
            return
        self._ready_models()
        rp = self.run_panel
        if rp.conversation.isChecked() and not rp.prompt_text().strip():
            self.show_error("Empty message", "type the next message of the conversation first")
            return
        self.running = True
        self._set_running_ui()
        self.msg.setText("running ...")
        self._sent = rp.prompt_text() if rp.conversation.isChecked() else None
        (self._chat if self._sent is not None else self._run).emit(rp.prompt_text(), rp.policy_text(),
                                                                   rp.max_new.value())

    def recalibrate(self, quick: bool = False) -> None:
        """Measure the loaded pair's cost profile again (saved for this machine and pair); the models
        are installed again with it, so a new session (and recording) starts."""
        if self.running or self.busy:
            return
        if self.worker.target is None:
            self.show_error("No models loaded", "load a model pair first (Run → Load models)")
            return
        self.msg.setText("recalibrating costs ...")
        self._recalibrate.emit(bool(quick))

    def new_conversation(self) -> None:
        """Conversation mode: the next turn starts a new conversation."""
        if self.running:
            return
        self._new_conv.emit()
        self._new_conv_pending = True
        self.msg.setText("the next message starts a new conversation")
        self._conversation_info()

    def _ready_models(self) -> None:
        """Leave a replay (or an attached server) and load the chosen pair if it is not the loaded one."""
        self.detach_server()
        if self.replayer is not None:
            self.leave_replay()
        pair = self.run_panel.pair()
        if not self.preloaded and self.loaded_pair != pair:
            self.load_models(*pair)

    def measure_all(self, repeats: int | None = None) -> None:
        """Measure every action (r, k) on the prompt in the editor, from the session's current
        cache and controller state (nothing is learned or stored by it), on the worker."""
        if self.running:
            return
        self._ready_models()
        R = int(repeats or self.run_panel.repeats.value())
        self.running = self.measuring = True
        self._set_running_ui()
        self.msg.setText("measuring every action ...")
        dlg = QProgressDialog("Measuring every action ...", "Cancel", 0, 0, self)
        dlg.setWindowTitle("Measure every action")
        # not modal: a modal QProgressDialog.setValue() runs processEvents(), which would deliver
        # the worker's next signals (even "measured", which deletes the dialog) re-entrantly
        dlg.setWindowModality(Qt.WindowModality.NonModal)
        dlg.setMinimumDuration(0)
        dlg.setAutoClose(False)
        dlg.setAutoReset(False)
        dlg.canceled.connect(self._cancel_measure)
        dlg.show()
        self.measure_dialog = dlg
        self._measure.emit(self.run_panel.prompt_text(), self.run_panel.max_new.value(), R)

    def _cancel_measure(self) -> None:
        if self.measuring:
            self.worker.stop()
            self.msg.setText("cancelling the measurement ...")

    def _on_measure_progress(self, done: int, total: int, what: str) -> None:
        dlg = self.measure_dialog
        if dlg is not None:
            dlg.setMaximum(total)
            dlg.setValue(done)
            dlg.setLabelText(f"Measuring every action: run {min(done + 1, total)} of {total}\n{what}")
        self.progress.setRange(0, max(1, total))
        self.progress.setValue(done)
        self.msg.setText(f"measuring every action: run {min(done + 1, total)} of {total} · {what}")

    def _on_measured(self, res) -> None:
        self.running = self.measuring = False
        dlg, self.measure_dialog = self.measure_dialog, None
        if dlg is not None:
            dlg.canceled.disconnect(self._cancel_measure)
            dlg.close()
            dlg.deleteLater()
        self._set_running_ui()
        if res is not None:
            c, o = res.choice, res.oracle
            self.msg.setText(f"measured {len(res.actions)} actions x {res.repeats}: oracle (r={o['reuse']}, k={o['k']})"
                             + (f", controller (r={c['reuse']}, k={c['k']}), regret {res.regret * 100:+.1f}%"
                                if res.regret is not None else ""))
            if not res.exact:
                self.show_error("Output mismatch", res.mismatch,
                                "Every action must produce the target's greedy output token for token. "
                                "The measurement is recorded with exact = false.")
        elif not self.msg.text().startswith("error"):
            self.msg.setText("measurement cancelled")
        self.redraw()
        self.measureFinished.emit(res)

    def stop(self) -> None:
        if self.running:
            self.worker.stop()
            self.msg.setText("stopping ...")
        elif self.replayer is not None and self.replayer.playing():
            self.replayer.pause()

    def _budget_changed(self, mib: float) -> None:
        self._budget.emit(mib)

    # ------------------------------------------------------------------ worker signals
    def _on_record(self, rec) -> None:
        self.live.apply(rec)           # tiny: the redraw timer does the drawing
        if getattr(rec, "tree_tokens", None) and self._tree_shown is not self.live:
            self._tree_shown = self.live           # the session's first tree: bring its tab forward once
            self.rounds_tabs.setCurrentWidget(self.tree)

    def _on_busy(self, what: str) -> None:
        self.busy = what
        self.lag.active = what.startswith(("generating", "measuring"))   # measure lag while generating
        self._busy_what, self._busy_t0, self._busy_shown = what, time.monotonic(), 0
        if what:
            self.msg.setText(what)
            self.progress.setRange(0, 0)
            self.progress.show()
        else:
            self.progress.hide()
        self._set_running_ui()

    def _on_progress(self, frac: float, what: str) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(frac * 1000))
        self._busy_what = f"calibrating costs: {what} ({frac * 100:.0f}%)"
        self.msg.setText(self._busy_what)

    def _busy_elapsed(self) -> None:
        """Loading or calibrating: the seconds so far after what the worker is doing (once a second)."""
        if not self.busy or self.running or self.busy.startswith(("generating", "measuring")):
            return
        el = int(time.monotonic() - self._busy_t0)
        if el != self._busy_shown:
            self._busy_shown = el
            self.msg.setText(f"{self._busy_what} · {el} s")

    def _on_loaded(self, info: dict) -> None:
        self.loaded_pair = getattr(self, "_want_pair", None) if not self.preloaded else None
        self.live = SessionState()
        self.live_pieces = Pieces(self.worker.tokenizer())
        if self.replayer is None and self.attachment is None:
            self.state = self.live
            self.tokens.pieces = self.live_pieces
        rec = info.get("recording") or "(not recorded)"
        notice = info.get("notice") or ""
        self.run_panel.set_loaded(f"loaded {info['target']} + {info['draft']} ({info.get('numerics', 'fp32')} numerics)"
                                  f"\nrecording to {Path(rec).name}" + (f"\n{notice}" if notice else ""))
        self.msg.setText(notice or f"models loaded · recording {rec}")
        if not self.preloaded:
            t, d = self.loaded_pair or ("", "")
            for role, spec in (("target", t), ("draft", d)):
                if spec:
                    self.settings.add_recent_model(role, spec)
        self.modelsLoaded.emit(info)

    def _on_finished(self, end) -> None:
        sent, self._sent = getattr(self, "_sent", None), None
        if sent is not None and end is not None and end.stopped != "error":
            self._new_conv_pending = False
            if self.run_panel.prompt_text() == sent:     # the message went into the conversation
                self.run_panel.prompt.clear()
        self.running = False
        self.live.close_open()             # also after an error in the middle of a request
        self.lag.active = False
        self._set_running_ui()
        if end is not None:
            self.msg.setText(f"request {end.request_id}: {len(end.output_ids)} tokens in {end.latency_ms:.0f} ms "
                             f"({end.stopped})")
        self.redraw()
        self.runFinished.emit(end)

    def _on_failed(self, msg: str, details: str) -> None:
        self.show_error("Cannot load models" if msg.startswith("cannot load") else "Engine error", msg, details)

    def _set_running_ui(self) -> None:
        self.run_panel.set_running(self.running, bool(self.busy) and not self.running)
        self.act_run.setEnabled(not self.running)
        self.act_measure.setEnabled(not self.running)
        self.act_stop.setEnabled(self.running)

    # ------------------------------------------------------------------ drawing (timer)
    def redraw(self, full: bool = True) -> None:
        """Bring the panels up to the state. The timer calls it with full=False: the token stream
        and status every tick, but at most one stale plot panel per tick (round-robin), so no
        single event-loop iteration pays for all the plots."""
        st = self.state
        key = (id(st), st.version)
        if key != self._drawn:
            t0 = time.perf_counter()
            self._drawn = key
            self.tokens.refresh(st)
            if self.central.currentWidget() is self.chat:     # rebuilt only where it shows
                self.chat.refresh(st)
            self._conversation_info()
            tps = st.live_tokens_per_s()
            ttft = st.ttft_ms()
            ex_ms, ex_share = st.exploration()
            rb = st.rounds_by_index
            threads = getattr(rb[max(rb)], "threads", 0) if rb else 0    # the latest step's (rakv.util.threads)
            self.stats.setText(f"{tps:.1f} tok/s · TTFT " + (f"{ttft:.0f} ms" if ttft is not None else "—")
                               + f" · exploration {ex_ms:.0f} ms ({ex_share * 100:.2f}% of session)"
                               + (f" · {threads} thread{'s' if threads > 1 else ''}" if threads else ""))
            self.redraw_ms_max = max(self.redraw_ms_max, (time.perf_counter() - t0) * 1e3)
        n = len(self.plots)
        for i in range(n):
            j = (self._rr + i) % n
            panel = self.plots[j]
            if self._plot_drawn.get(j) == key:
                continue
            t0 = time.perf_counter()
            panel.refresh(st)
            self._plot_drawn[j] = key
            self.redraw_ms_max = max(self.redraw_ms_max, (time.perf_counter() - t0) * 1e3)
            if not full:
                self._rr = (j + 1) % n
                break
        if self.vllm_panel is not None:
            self.vllm_panel.refresh()
        self._busy_elapsed()
        mx, p99, n = self.lag.stats()
        if n:
            self.lag_label.setText(f"lag max {mx:.0f} ms · p99 {p99:.0f} ms")

    def _conversation_info(self) -> None:
        """The run panel's line under the Conversation box: the conversation so far."""
        st = self.state
        if getattr(self, "_new_conv_pending", False) and st is self.live:
            text = "the next message starts a new conversation"
        elif st.turn is not None:
            c = st.turn.conversation
            turns = [t for t in st.turns if t.conversation == c and t.request_id <= st.turn.request_id]
            n = st.turn.prompt_tokens + st.turn.output_tokens
            text = (f"conversation {c}: {len(turns)} turn{'s' if len(turns) != 1 else ''}, {n} tokens"
                    + (f"; the last turn reused {st.turn.from_before} of the {st.turn.previous_tokens} before it"
                       if st.turn.turn > 1 else ""))
        else:
            text = "the next message starts a conversation"
        self.run_panel.set_conversation_info(text)

    def panel_snapshot(self) -> dict:
        self.redraw()
        self.chat.refresh(self.state)
        snap = {name: p.snapshot() for name, p in (("tokens", self.tokens), ("chat", self.chat), ("cache", self.cache),
                                                    ("costs", self.costs), ("acceptance", self.acceptance),
                                                    ("timeline", self.timeline), ("tree", self.tree),
                                                    ("batch", self.batch))}
        if self.vllm_panel is not None:
            snap["vllm"] = self.vllm_panel.snapshot()
        return snap

    # ------------------------------------------------------------------ replay
    def open_recording(self, path: str | None = None, play: bool = True) -> bool:
        from rakv.records import RecordingError, read_recording

        if path is None:
            start = str(sessions_dir())
            path, _ = QFileDialog.getOpenFileName(self, "Open recording", start, "Recordings (*.jsonl);;All files (*)")
            if not path:
                return False
        try:
            recs = read_recording(path)
            check_replayable(recs)
        except RecordingError as e:
            self.show_error("Cannot open recording", str(e))
            return False
        for w in recs.warnings:          # e.g. a cut-off last line: the rest replays
            self.show_warning("Recording cut off", w)
        self.detach_server()
        if self.replayer is not None:
            self.replayer.pause()
        self.replayer = Replayer(recs, str(path), self)
        self.replayer.stateReplaced.connect(self._replay_state)
        self.replayer.finished.connect(self.replayFinished)
        self.state = self.replayer.state
        self.tokens.pieces = Pieces(None, load_pieces(path))
        speed = str(self.settings.get("replay/speed"))
        if speed == "max":                   # a replay starts playing at a speed one can watch
            speed = Settings.DEFAULTS["replay/speed"]
        self.replay_bar.attach(self.replayer, Path(path).name, speed)
        self.replay_tb.show()
        self.setWindowTitle(f"RAKV Explorer — replay {Path(path).name}")
        self.settings.add_recent_recording(str(path))
        self.msg.setText(f"replaying {path}: {len(recs)} records"
                         + (f" (cut off after line {recs.lines[-1]})" if recs.warnings and recs.lines else ""))
        if play:
            self.replayer.play()
        return True

    def _replay_state(self, st: SessionState) -> None:
        self.state = st

    def leave_replay(self) -> None:
        if self.replayer is not None:
            self.replayer.pause()
            self.replayer.deleteLater()
        self.replayer = None
        self.replay_tb.hide()
        self.state = self.live
        self.tokens.pieces = self.live_pieces
        self.setWindowTitle("RAKV Explorer")

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        items = self.settings.recent_recordings()
        for p in items:
            self.recent_menu.addAction(Path(p).name, lambda p=p: self.open_recording(p)).setToolTip(p)
        if not items:
            self.recent_menu.addAction("(none)").setEnabled(False)

    # ------------------------------------------------------------------ an attached server
    def attach_server(self, url: str | None = None) -> bool:
        """Show a running `rakv serve`'s requests live, read-only (None: ask for its address)."""
        from app.attach import attach

        return attach(self, url)

    def detach_server(self) -> None:
        from app.attach import detach

        detach(self)

    # ------------------------------------------------------------------ a watched vLLM server
    def watch_vllm(self, url: str | None = None, profile: str | None = None, interval: float | None = None) -> bool:
        """Poll a vLLM server's /metrics, read-only (None: ask for its address); ``profile``: a vLLM
        cost profile for the crossover (None: the remembered one, "": none)."""
        from app.vllm_watch import watch

        return watch(self, url, profile, interval)

    def unwatch_vllm(self) -> None:
        from app.vllm_watch import unwatch

        unwatch(self)

    # ------------------------------------------------------------------ export (app/exports.py)
    def export_csv(self, path: str | None = None) -> int | None:
        return exports.export_csv(self, path)

    def copy_answer(self) -> str | None:
        """The latest answer of the shown session to the clipboard (plain text)."""
        return exports.copy_answer(self)

    def export_conversation(self, path: str | None = None) -> str | None:
        """The transcript of the shown session as Markdown (.md) or JSON (.json)."""
        return exports.export_conversation(self, path)

    def export_plots(self, folder: str | None = None) -> list[str]:
        return exports.export_plots(self, folder)

    def _show_sessions(self) -> None:
        from PySide6.QtCore import QUrl
        from PySide6.QtGui import QDesktopServices

        QDesktopServices.openUrl(QUrl.fromLocalFile(str(sessions_dir())))

    # ------------------------------------------------------------------ errors, about
    def show_error(self, title: str, msg: str, details: str = "") -> None:
        """A non-blocking dialog; the window stays usable."""
        self.errors.append(msg)
        self.msg.setText(f"error: {msg}")
        print(f"rakv-explorer: {title}: {msg}", file=sys.stderr)
        box = QMessageBox(QMessageBox.Icon.Critical, title, msg, QMessageBox.StandardButton.Ok, self)
        if details:
            box.setDetailedText(details)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()
        self.errorShown.emit(msg)

    def show_warning(self, title: str, msg: str) -> None:
        """A non-fatal, non-blocking notice (the action goes on)."""
        print(f"rakv-explorer: warning: {msg}", file=sys.stderr)
        self.warnings.append(msg)
        box = QMessageBox(QMessageBox.Icon.Warning, title, msg, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()

    def excepthook(self, etype, value, tb) -> None:
        details = "".join(traceback.format_exception(etype, value, tb))
        self.show_error("Unexpected error", f"{etype.__name__}: {value}", details)

    def about(self) -> None:
        QMessageBox.about(self, "About RAKV Explorer", about_text())

    # ------------------------------------------------------------------ shutdown
    def closeEvent(self, ev) -> None:
        self.save_settings()
        self.shutdown()
        super().closeEvent(ev)

    def shutdown(self) -> None:
        self.redraw_timer.stop()
        self.lag.stop()
        self.detach_server()
        self.unwatch_vllm()
        if self.replayer is not None:
            self.replayer.pause()
        if self.thread_.isRunning():
            self.worker.stop()
            self.thread_.quit()
            self.thread_.wait(10000)
        self.worker.close_recording()
        self.gc_guard.stop()


def about_text() -> str:
    import numpy
    import pyqtgraph
    import PySide6
    import torch
    import transformers
    from PySide6.QtCore import qVersion

    import rakv

    rows = [("RAKV Explorer", rakv.__version__), ("Python", sys.version.split()[0]),
            ("PySide6", PySide6.__version__), ("Qt", qVersion()), ("pyqtgraph", pyqtgraph.__version__),
            ("torch", torch.__version__), ("transformers", transformers.__version__), ("numpy", numpy.__version__)]
    table = "".join(f"<tr><td>{a}</td><td>&nbsp;{b}</td></tr>" for a, b in rows)
    return ("<p><b>RAKV Explorer</b>: exact speculative decoding with cross-request prefix KV reuse, "
            "steered by a measured-cost controller.</p>"
            f"<table>{table}</table><p>torch threads: {torch.get_num_threads()}</p>")


def app_instance() -> QApplication:
    return QApplication.instance() or QApplication(sys.argv)
