"""The decision, in one place: reuse or not, draft how far, and what it costs on this machine.

Modules, bottom-up (each imports only those before it; nothing here imports the engine, the CLI,
the server, the bench or the GUI):

  ``policy``       the pure maths: E_k, E_shaped, overshoot, alpha* (``crossover``,
                   ``round_crossover``, ``alpha_star``), ``root_falling``, ``round_draft_ms``,
                   ``drafting_ks``, the margins, the gate's ``worth_more`` / ``best_verify_length``
  ``profile``      ``CostProfile`` (the measured terms, ``interp``, online scales), fingerprints,
                   reading, validating and writing profiles; the vLLM proposer's profile
  ``learned``      the mutable learned state: ``AlphaEWMA``, ``Acceptance`` (per sampling setting)
  ``gate``         the confidence gate's acceptance maps and round stopping rule
  ``controller``   the per-request and per-round decision (``Controller``)
  ``planner``      the engine's one door to the decision per round (``RoundPlanner``)
  ``calibration``  measures a profile by running the model pair
  ``regime``       what this machine's profile says about speculation
  ``oracle``       measures every action on one prompt

Import the names from their module (``from rakv.decide.profile import CostProfile``): this door
imports nothing, so a module below the decision may read the pure maths without a circle.
"""
