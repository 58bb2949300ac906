"""The worker: a QObject living on its own QThread that owns the models and the engine.

Commands come in as queued slot calls (load models, run, chat, new conversation, set budget);
records go out through the queued ``record`` signal. The engine callback runs on this thread and
only writes the recording line and emits the signal; all GUI work happens on the GUI thread, on a
timer. Conversation mode keeps a ``rakv.engine.chat.Conversation`` here, beside the engine.

Thread-safety of the live controls:
  * ``stop()`` is called directly from the GUI thread: ``Engine.stop`` sets a threading.Event,
    which the decode loop checks once per round.
  * K set, force (r, k) and granularity are applied directly from the GUI thread too
    (``set_controls``): ``Engine.set_k_set`` takes the engine's lock and the other two are single
    attribute writes; the engine reads them at its next decision (next round or next request).
  * The memory budget goes through the worker's queue (``set_budget`` slot): changing it evicts
    prefix-cache entries, which must not race the prefill that is storing/looking up entries on
    this thread. It takes effect between requests, i.e. at the next per-request decision, which
    is the only decision that uses it.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from rakv.config import RakvConfig
from rakv.config import Sampling


@dataclass
class Controls:
    budget_mib: float = 512.0
    k_set: tuple[int, ...] = (0, 1, 2, 4, 6, 8)
    force: tuple[int, int] | None = None
    granularity: str = "round"
    chat_template: bool = True        # False: the explorer's "Raw prompt" box is checked
    sampling: Sampling = field(default_factory=Sampling)   # temperature 0 = greedy (the sampling controls)


class Worker(QObject):
    record = Signal(object)           # every engine record (RunHeader, RequestStart, ...)
    busy = Signal(str)                # what the worker is doing ("" = idle)
    progress = Signal(float, str)     # calibration progress 0..1
    loaded = Signal(dict)             # {"target": name, "draft": name, "recording": path}
    finished = Signal(object)         # RequestEnd, or None after an error
    measureProgress = Signal(int, int, str)   # runs done, runs in all, what runs next
    measured = Signal(object)         # OracleResult, or None (cancelled or an error)
    failed = Signal(str, str)         # one-line message, details (traceback)

    def __init__(self, sessions: Path | None = None):
        super().__init__()
        self.sessions = sessions
        self.device = "auto"              # --device (resolved by rakv.load.load_model)
        self.fast: bool | None = None     # --fast / --no-fast; None: RAKV_FAST, default on
        self.numerics = "auto"            # --numerics / the run panel's choice: auto | q8 | fp32
        self.threads: int | None = None   # --threads: pinned; None: the engine's count adapts
        self.target = None
        self.draft = None
        self.profile = None
        self.engine = None
        self.recorder = None
        self.recording: Path | None = None
        self.pair: tuple[str, str] | None = None
        self.controls = Controls()
        self._seen_ids: set[int] = set()
        self._load_failed = False
        self._persist = False
        self._lock = threading.Lock()
        self._oracle = None               # the running "measure every action", if any
        self.conversation = None          # conversation mode: rakv.engine.chat.Conversation over the engine

    # ------------------------------------------------------------------ models (worker thread)
    @Slot(str, str, int)
    def load_models(self, target: str, draft: str, k_max: int = 8) -> None:
        from rakv.session import build

        try:
            self.busy.emit(f"loading {target} + {draft} ...")
            config = RakvConfig(target=target, draft=draft, device=self.device, numerics=self.numerics,
                                threads=self.threads,
                                **({} if self.fast is None else {"fast": self.fast}))
            # the draft made at once; no collection on this thread (collections run on the GUI thread:
            # app.gcguard); the engine is made by _install, with the controls' config
            s = build(config, k_max=max(1, k_max), calibrate=True, engine=False, eager_draft=True, collect=False,
                      on_loaded=lambda s: self.busy.emit("cost profile (calibrating once for this machine and pair) ..."),
                      progress=lambda f, w: self.progress.emit(f, w), log=self._say, announce=False)
            self._install(s.target, s.draft, s.profile, (target, draft))
            self._persist = True              # learning goes back to the user's profile
        except Exception as e:  # noqa: BLE001 - any failure becomes a dialog
            self._load_failed = True          # the run queued behind this load is skipped
            self._fail(f"cannot load models: {e}", e)
        finally:
            self.busy.emit("")

    def _say(self, msg: str) -> None:
        """A calibration's line (its estimate, a contended profile's note): stderr and the status bar."""
        print(f"[rakv] {msg}", file=sys.stderr, flush=True)
        self.busy.emit(msg)

    @Slot(bool)
    def recalibrate(self, quick: bool = False) -> None:
        """Measure the loaded pair's cost profile again (``rakv.session.get_profile(force=True)``:
        saved for this machine and pair, so the CLI uses it too), then install the models with it: a
        new engine, session and recording (the run header says the new profile's quality)."""
        from rakv.session import get_profile

        if self.target is None:
            self._fail("no models loaded", None)
            return
        try:
            self.busy.emit("recalibrating costs ...")
            k_max = max((8, *self.controls.k_set))
            prof = get_profile(self.target, self.draft, k_max, force=True, quick=quick,
                               progress=lambda f, w: self.progress.emit(f, w), log=self._say, announce=False)
            persist = self._persist
            self._install(self.target, self.draft, prof, self.pair)
            self._persist = persist
        except Exception as e:  # noqa: BLE001 - any failure becomes a dialog
            self._fail(f"cannot recalibrate: {e}", e)
        finally:
            self.busy.emit("")

    @Slot(object)
    def use_models(self, bundle) -> None:
        """Install preloaded models: ``(target LoadedModel, DraftSource, CostProfile | None)``."""
        try:
            t, d, prof = bundle
            self._install(t, d, prof, (t.name, getattr(d, "name", "none")))
        except Exception as e:  # noqa: BLE001
            self._fail(f"cannot use models: {e}", e)

    def _install(self, target, draft, profile, pair) -> None:
        from rakv.records import Recorder
        from rakv.session import Session

        self.close_recording()
        self._load_failed = False
        self._persist = False
        self._seen_ids = set()
        self.target, self.draft, self.profile, self.pair = target, draft, profile, pair
        with self._lock:
            c = self.controls
            config = RakvConfig(target=pair[0], draft=pair[1], k_set=c.k_set, budget_mib=c.budget_mib,
                                device=str(next(target.model.parameters()).device), fast=bool(target.fast),
                                granularity=c.granularity, force_action=c.force,
                                chat_template=c.chat_template, sampling=c.sampling,
                                policy="adaptive" if profile is not None else "ar", threads=self.threads)
            self.engine = Session(config, target, draft, profile).new_engine(self._on_record)
        self.conversation = None
        if self.sessions is not None:
            self.recording = self.sessions / time.strftime("session-%Y%m%d-%H%M%S.jsonl")
            n = 1
            while self.recording.exists():
                n += 1
                self.recording = self.sessions / time.strftime(f"session-%Y%m%d-%H%M%S-{n}.jsonl")
            self.recorder = Recorder(self.recording)
        # "loaded" first: the GUI starts a fresh session state, which then receives the header
        from rakv.prompts import template_notice

        self.loaded.emit({"target": target.name, "draft": getattr(draft, "name", "none"),
                          "numerics": getattr(target, "numerics", "fp32"),
                          "notice": template_notice(target.tokenizer, c.chat_template, target.name).replace(
                              "pass --raw", "tick raw prompt"),
                          "recording": str(self.recording) if self.recording else ""})
        self.engine.header()

    def _on_record(self, rec) -> None:
        """Engine callback (worker thread): record the line, emit the record. Nothing else."""
        if self.recorder is not None:
            self.recorder(rec)
        if getattr(rec, "tree_tokens", None):
            self._seen_ids.update(rec.tree_tokens)     # the tree's rejected nodes too, for the pieces file
        self.record.emit(rec)

    # ------------------------------------------------------------------ run (worker thread)
    def _ready(self, done) -> bool:
        """Whether there are models to run on. If not, ``done`` (the command's closing signal) is
        emitted with None: after a failed load (already reported) the command is skipped, so it does
        not run the previous pair; with no models at all, a dialog says so."""
        if self._load_failed:
            self._load_failed = False
            done.emit(None)
            return False
        if self.engine is None:
            self._fail("no models loaded", None)
            done.emit(None)
            return False
        return True

    def _save_learning(self) -> None:
        """What the engine learned goes back to the user's profile (models loaded here, not preloaded
        ones); best effort: a failure to write it loses only that learning."""
        if self._persist and self.profile is not None:
            from rakv.decide.profile import save_learned
            from rakv.util.paths import cache_dir

            save_learned(self.profile, cache_dir())

    def _request(self, policy: str, go) -> None:
        """One request (run or chat turn): ``go()`` runs it and gives its RequestEnd and the prompt
        its token pieces are saved with; then learning is saved. An error becomes a dialog;
        ``finished`` always follows (with None after an error)."""
        if not self._ready(self.finished):
            return
        end = None
        try:
            self.busy.emit("generating ...")
            self.engine.set_policy(policy)
            end, prompt = go()
            self._write_pieces(prompt, end)
            self._save_learning()
        except Exception as e:  # noqa: BLE001
            self._fail(str(e) or type(e).__name__, e)
        finally:
            self.busy.emit("")
            self.finished.emit(end)

    @Slot(str, str, int)
    def run(self, prompt: str, policy: str, max_new_tokens: int) -> None:
        self._request(policy, lambda: (self.engine.generate(prompt, max_new_tokens), prompt))

    @Slot(str, str, int)
    def chat(self, text: str, policy: str, max_new_tokens: int) -> None:
        """Conversation mode: ``text`` is the next user turn of the conversation (rakv.engine.chat): its
        prompt is the whole conversation, and its prompt and answer stay in the prefix cache."""
        from rakv.engine.chat import Conversation, run_turn

        def turn():
            conv = self.conversation
            if conv is None or conv.raw != (not self.engine.chat_template):   # new, or the raw box changed
                number = conv.number + 1 if conv is not None and conv.turns else 1
                conv = self.conversation = Conversation.for_engine(self.engine, number=number)
            end = run_turn(self.engine, conv, text, max_new_tokens)
            return end, (conv.turns[-1].prompt_ids if conv.turns else [])

        self._request(policy, turn)

    @Slot()
    def new_conversation(self) -> None:
        """The next conversation-mode turn starts a new conversation (the prefix cache keeps its entries)."""
        if self.conversation is not None and self.conversation.turns:
            self.conversation.reset()

    @Slot(str, int, int)
    def measure(self, prompt: str, max_new_tokens: int, repeats: int) -> None:
        """Measure every action (r, k) on ``prompt`` from the engine's current state
        (``rakv.decide.oracle``); the OracleResult is recorded and emitted like any record."""
        from rakv.decide.oracle import Oracle

        if not self._ready(self.measured):
            return
        res = None
        try:
            self.busy.emit("measuring every action ...")
            self._oracle = Oracle(self.engine, repeats,
                                  progress=lambda done, total, what: self.measureProgress.emit(done, total, what))
            res = self._oracle.measure(prompt, max_new_tokens)
        except Exception as e:  # noqa: BLE001
            self._fail(str(e) or type(e).__name__, e)
        finally:
            self._oracle = None
            self.busy.emit("")
            self.measured.emit(res)

    @Slot(float)
    def set_budget(self, mib: float) -> None:
        with self._lock:
            self.controls.budget_mib = float(mib)
        if self.engine is not None:
            self.engine.set_budget_mib(mib)

    # ------------------------------------------------------------------ any thread
    def stop(self) -> None:
        o = self._oracle
        if o is not None:
            o.stop()
            return
        eng = self.engine
        if eng is not None:
            eng.stop()

    def set_controls(self, k_set=None, force="keep", granularity=None, chat_template=None,
                     sampling=None) -> None:
        """Called from the GUI thread; acts on the engine's next decision (sampling: next request)."""
        with self._lock:
            c = self.controls
            if sampling is not None:
                c.sampling = sampling
                if self.engine is not None:
                    self.engine.set_sampling(sampling)
            if k_set is not None:
                c.k_set = tuple(sorted({int(k) for k in k_set}))
            if force != "keep":
                c.force = None if force is None else (int(force[0]), int(force[1]))
            if granularity is not None:
                c.granularity = granularity
            if chat_template is not None:
                c.chat_template = bool(chat_template)
            eng = self.engine
            if eng is not None:
                if k_set is not None:
                    eng.set_k_set(c.k_set)
                if force != "keep":
                    eng.set_force(c.force)
                if granularity is not None:
                    eng.set_granularity(c.granularity)
                if chat_template is not None:
                    eng.set_chat_template(c.chat_template)

    def tokenizer(self):
        return getattr(self.target, "tokenizer", None)

    # ------------------------------------------------------------------ helpers
    def _write_pieces(self, prompt, end) -> None:
        """Next to the recording: token id -> text piece, so replays show text without models."""
        if self.recording is None or self.tokenizer() is None:
            return
        from app.pieces import save_pieces

        self._seen_ids.update(self.engine.encode(prompt) if isinstance(prompt, str) else prompt)
        self._seen_ids.update(end.output_ids)
        save_pieces(self.recording, self.tokenizer(), self._seen_ids)

    def close_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def _fail(self, msg: str, exc: BaseException | None) -> None:
        details = "".join(traceback.format_exception(exc)) if exc is not None else ""
        self.failed.emit(msg.strip().splitlines()[0] if msg.strip() else "error", details)
