"""The ``--draft`` names and what makes each: ``make_draft(spec, target, config)``.

A name maps to its module's ``make(target, config, arg)``; a name ending in ":" takes an argument
(``layers:L``: ``arg`` is what follows the colon). Anything else is a draft model to load (a hub
id, a local folder, a ``.gguf`` file, a preset) with the target's tokenizer. A new draft is one
module in this package and one line in ``DRAFTS``.
"""

from __future__ import annotations

from ..load import hub
from ..load.loaded import LoadedModel, ModelError
from ..load.numerics import set_fast
from ..load.tokenizer import check_same_tokenizer
from . import int8, layers, ngram, none
from .base import DraftSource
from .model import ModelDraft

DRAFTS = {
    "none": none.make,
    "ngram": ngram.make,
    "int8": int8.make,
    "layers:": layers.make,
}

DRAFT_CODES = ("file", "q4")


def make_draft(spec: str, target: LoadedModel, config) -> DraftSource:
    """--draft: a model (hub id / dir / .gguf / preset) or one of ``DRAFTS`` ('int8', 'layers:L',
    'ngram', 'none'). ``config``: the run's ``rakv.config.RakvConfig``."""
    s = (spec or "none").strip()
    if s in DRAFTS:
        return DRAFTS[s](target, config, "")
    name, colon, arg = s.partition(":")
    if colon and name + ":" in DRAFTS:
        return DRAFTS[name + ":"](target, config, arg)
    lm = hub.load_model(s, config.dtype, None, config.device, fast=config.fast,
                        numerics="q8" if target.numerics == "q8" and config.numerics != "fp32" else config.numerics)
    check_same_tokenizer(target, lm)
    codes = draft_codes(lm, config.draft_codes)
    if codes != "file":
        narrow_draft(lm, codes)
    return ModelDraft(lm, vocab=draft_vocab(lm, config.draft_vocab))


def draft_codes(lm: LoadedModel, codes: str) -> str:
    """--draft-codes: ``auto`` narrows a q8 draft to 4-bit codes, as its file's Q8_0 / Q5_0 / Q6_K
    layers cost it more bytes a step for a small change in what it drafts (docs/results.md, the
    draft's codes); fp32 numerics keep the file's codes."""
    if codes == "auto":
        return "q4" if lm.numerics == "q8" else "file"
    return codes


def narrow_draft(lm: LoadedModel, codes: str) -> LoadedModel:
    """A draft model's codes: ``file`` (as its file holds them) or ``q4`` (every layer wider than 4
    bits requantized to Q4_1, under q8 numerics): a cheaper draft step for a small change in what it
    proposes; every policy stays exact, since the target verifies every token. In place; returns lm."""
    if codes not in DRAFT_CODES:
        raise ModelError(f"--draft-codes must be one of {', '.join(DRAFT_CODES)}, not {codes!r}")
    want = "q4" if codes == "q4" else ""
    if want == lm.narrow:
        return lm
    if want and lm.numerics != "q8":
        raise ModelError(f"--draft-codes q4 needs q8 numerics for the draft ({lm.name} runs {lm.numerics})")
    lm.narrow = want
    return set_fast(lm, lm.fast)            # the key gets "+n4": its own cost profile and cache entries


def draft_vocab(lm: LoadedModel, n: int) -> int:
    """A separate draft model of at least 2n ids drafts from its first ``n``: its full head is a
    large share of a small draft's bytes a step (docs/results.md, the draft's vocabulary); a
    vocabulary under 2n keeps every id (the head would not even halve)."""
    return n if n > 0 and lm.vocab_size >= 2 * n else 0
