"""One assembled session: the target, its draft, the cost profile and the engine over them.

Every front end gets its models and engine here: ``rakv generate`` / ``chat`` / ``serve`` /
``calibrate`` (rakv.cli), ``rakv bench`` (one session, an engine per arm) and the explorer's worker
(on its own thread). ``build(config)`` loads the pair the config names, measures or loads the cost
profile where the policy needs one, and makes the engine; ``load(config)`` stops after the models
(the bench and ``rakv calibrate`` decide about the profile later).

    s = build(config, callback, k_max=8)        # s.target, s.draft, s.profile, s.engine
    e = s.new_engine(callback, config=config.with_(policy="ar"), profile=None)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from .config import Policy, RakvConfig

_SAME = object()      # new_engine's default profile: the session's own


@dataclass
class Session:
    """The models of one config and what was built over them."""

    config: RakvConfig
    target: object                 # rakv.models.LoadedModel
    draft: object                  # a rakv.drafts.DraftSource
    profile: object = None         # rakv.costs.CostProfile, once calibrate() gave one
    engine: object = None          # rakv.engine.Engine, once build() or new_engine() made one

    def calibrate(self, k_max: int, *, force: bool = False, quick: bool = False, progress=None, log=None,
                  announce: bool = True):
        """The cost profile for this machine and pair (measured once, then read back), with the
        acceptance prior at the config's sampling setting measured now if it is new; kept as
        ``self.profile``. ``progress(frac, what)`` and ``log(line)`` default to stderr; ``announce``
        logs a fresh calibration's time and alpha0."""
        self.profile = get_profile(self.target, self.draft, k_max, force=force, quick=quick, progress=progress,
                                   log=log, sampling=self.config.sampling, announce=announce)
        return self.profile

    def new_engine(self, callback=None, *, config: RakvConfig | None = None, profile=_SAME):
        """An engine over this session's models: its own prefix cache and controller; ``config``
        (default the session's) and ``profile`` (default the session's; None: no profile) as given."""
        from .engine import Engine

        return Engine(self.target, self.draft, config or self.config, callback,
                      self.profile if profile is _SAME else profile)

    def save_learned(self) -> None:
        """Keep what this session's profile learned for the next one (nothing without a profile)."""
        if self.profile is not None:
            save_learned(self.profile)


def build(config: RakvConfig, callback=None, *, k_max: int | None = None, calibrate: bool | None = None,
          recalibrate: bool = False, quick: bool = False, progress=None, log=None, announce: bool = True,
          on_loaded=None, engine: bool = True, eager_draft: bool = False, collect: bool = True) -> Session:
    """The session of ``config``: its models (``load``), then ``on_loaded(session)`` if given (a
    front end's notice or status line), then the cost profile when ``calibrate`` (default: an
    adaptive policy or ``recalibrate``; ``recalibrate`` measures it again), then the engine with
    ``callback`` (unless ``engine`` is False). ``k_max``: the largest k the profile measures
    (default the config's largest k, at least 1)."""
    s = load(config, recalibrate=recalibrate, eager_draft=eager_draft, collect=collect)
    if on_loaded is not None:
        on_loaded(s)
    if calibrate is None:
        calibrate = recalibrate or _adaptive(config)
    if calibrate:
        s.calibrate(k_max if k_max is not None else max(max(config.k_set), 1), force=recalibrate, quick=quick,
                    progress=progress, log=log, announce=announce)
    if engine:
        s.engine = s.new_engine(callback)
    return s


def load(config: RakvConfig, *, recalibrate: bool = False, eager_draft: bool = False,
         collect: bool = True) -> Session:
    """The target and draft ``config`` names (torch's threads set first where it names a count).
    ``--draft int8`` is made when first used by a policy that never drafts or drafts only where
    its measured costs say it pays, unless ``recalibrate`` (calibrating measures it) or
    ``eager_draft``. Then what lives leaves the collector's reach (``settle_heap(collect)``)."""
    import torch

    from .drafts.registry import make_draft
    from .load.hub import load_model
    from .util.threads import process_meter

    process_meter()          # the adaptive thread count's first look at the machine spans the load
    if config.threads:
        torch.set_num_threads(config.threads)      # range checked by the flags' parser
    target = load_model(config.target, config.dtype, config.revision, config.device, fast=config.fast,
                        numerics=config.numerics)
    if (config.draft or "").strip() == "int8" and not recalibrate and not eager_draft and not _drafts_at_once(config):
        from .drafts.model import ModelDraft
        from .drafts.int8 import int8_copy

        draft = ModelDraft(int8_copy(target, lazy=True))
    else:
        draft = make_draft(config.draft, target, config)
    settle_heap(collect)
    return Session(config, target, draft)


def settle_heap(collect: bool = True) -> None:
    """After loading: what lives now (torch, transformers, the models) leaves the cyclic
    collector's reach, so a full collection walks only what requests make (otherwise a full
    collection walks every loaded object, in whichever round allocated past the threshold:
    docs/fastpath.md#the-collector). ``collect=False`` freezes without collecting first (a thread
    that must not finalize Qt objects: the explorer's worker)."""
    import gc

    if collect:
        gc.collect()
    gc.freeze()


def _adaptive(config: RakvConfig) -> bool:
    try:
        return Policy.parse(config.policy).adaptive
    except ValueError:
        return False


def _drafts_at_once(config: RakvConfig) -> bool:
    """Does this config's policy draft from its first round (a fixed k > 0)? An unparsable policy
    counts as one (the engine reports it)."""
    try:
        p = Policy.parse(config.policy)
    except ValueError:
        return True
    return not p.adaptive and p.k > 0


def get_profile(target, draft, k_max: int, force: bool = False, quick: bool = False, progress=None,
                sampling=None, log=None, announce: bool = True):
    """The cost profile for this machine + pair (calibrates once; progress(frac, what) if given),
    with the acceptance prior at ``sampling``'s setting measured now if it is new."""
    from .decide.calibration import load_or_calibrate, text_progress
    from .util.paths import cache_dir
    from .util.paths import log as stderr_log

    say = log or stderr_log
    prof, fresh = load_or_calibrate(target, draft, cache_dir(), k_max=k_max, force=force, quick=quick,
                                    progress=progress or text_progress(), log=say)
    if fresh and announce:
        say(f"calibrated in {prof.calibration_s:.1f} s (alpha0={prof.alpha0:.2f})")
    prior_at_setting(prof, target, draft, sampling)
    return prof


def prior_at_setting(profile, target, draft, sampling) -> None:
    """Measure a new sampling setting's acceptance prior before any request, and keep it in the
    saved profile: measured inside a request it would be charged to that request's latency."""
    from .decide.calibration import alpha_prior
    from .util.paths import log

    if sampling is None or sampling.greedy or sampling.key() in profile.alpha_by_setting:
        return
    t0 = time.perf_counter()
    a0 = alpha_prior(profile, target, draft, sampling)
    log(f"acceptance prior at {sampling.key()}: {a0:.2f} (measured once per setting, {time.perf_counter() - t0:.1f} s)")
    save_learned(profile)


def save_learned(profile) -> None:
    """Keep what this session learned (cost scales, acceptance) for the next one; the output share for display."""
    from .decide.profile import save_learned as save
    from .util.paths import cache_dir

    err = save(profile, cache_dir())
    if err:   # a read-only cache dir loses the learning, not the run
        print(f"[rakv] could not save the learned profile: {err}", file=sys.stderr)
