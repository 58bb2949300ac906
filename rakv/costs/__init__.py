"""The measured cost model: its maths, its profiles on disk, and the calibration that fills them.

Three modules, each above the one before: ``model`` (``CostProfile``: the terms and their online
refinement, pure arithmetic), ``profile`` (fingerprints, the file format, validation) and
``calibration`` (runs the model pair to measure every term). This door re-exports their public
names for the layers above (engine, cli, bench, app); the controller imports ``model`` alone.
"""

from .calibration import (busy_now, calibrate, calibration_ids, check_profile, load_or_calibrate,
                        measure_alpha, quiet_probe, regime_figures, remeasure_if_quiet, text_progress)
from .model import PROFILE_VERSION, CostProfile, interp, lookup_vs
from .profile import (ProfileError, fingerprint, fingerprint_id, load_profile, pair_fingerprint,
                      profile_path, profile_problem, quality_summary, save_learned, save_profile, saved_profile)

__all__ = ["PROFILE_VERSION", "CostProfile", "ProfileError", "busy_now", "calibrate", "calibration_ids",
           "check_profile", "fingerprint", "fingerprint_id", "interp", "load_or_calibrate",
           "load_profile", "lookup_vs", "measure_alpha", "pair_fingerprint", "profile_path",
           "profile_problem", "quality_summary", "quiet_probe", "regime_figures", "remeasure_if_quiet", "save_learned", "save_profile",
           "saved_profile", "text_progress"]
