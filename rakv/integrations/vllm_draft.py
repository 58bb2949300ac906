"""A draft model inside vLLM's worker: rakv's own engine drafting for the vLLM target.

The RAKV proposer (``vllm_proposer.RakvProposer``) can draft with a model as well as with free
n-gram copies. The draft is any model rakv loads (``demo``, a preset, a ``.gguf``, a folder),
run by rakv's engine in the vLLM worker's process, by default from its codes in integer
arithmetic (``numerics="q8"``): for a target that vLLM serves in fp32 or bf16 on a CPU, the
target's own GGUF codes make a draft that costs a fraction of vLLM's step and agrees with it on
most tokens; a smaller sibling (Qwen2.5-Coder-0.5B for the 1.5B) works the same way. It must
share the target's tokenizer (ids beyond the target's vocabulary end a draft).

Each request has its own ``rakv.drafts.ModelDraft`` (its own KV cache, rolled back to what vLLM
accepted). The costs the decision needs are measured here, on this process, at load: ``d`` (one
draft forward) and a prompt's prefill per token, refined by every round that runs.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("rakv.vllm")

DRAFT_ENV = "RAKV_VLLM_DRAFT"              # the draft model (a rakv model spec); unset: copies only
NUMERICS_ENV = "RAKV_VLLM_DRAFT_NUMERICS"  # its numerics (q8 default, fp32)
EMA = 0.1                                  # weight of one round in the running draft costs
REMAINING_MIN = 16                         # the fewest tokens a running request is assumed to have left
PRIOR_TRIALS = 8                           # a request's own model acceptance counts after this many judged drafts

_LOADED: dict[tuple, object] = {}          # (spec, numerics) -> LoadedModel: arms of one engine share it


def load_draft(spec: str, numerics: str = "q8"):
    """The draft's LoadedModel (loaded once per process)."""
    key = (spec, numerics)
    if key not in _LOADED:
        from ..load.hub import load_model

        t0 = time.perf_counter()
        _LOADED[key] = load_model(spec, numerics=numerics)
        log.info("RakvProposer: draft %s (%s) loaded in %.1f s", spec, numerics, time.perf_counter() - t0)
    return _LOADED[key]


class DraftCosts:
    """A draft forward's ms (d) and a prompt prefill's ms per token, measured in this process."""

    def __init__(self, d_ms: float, prefill_ms_tok: float):
        self.d_ms, self.prefill_ms_tok = d_ms, prefill_ms_tok

    @classmethod
    def measure(cls, lm, n_prompt: int = 64, steps: int = 8) -> "DraftCosts":
        """Warm up, then time a prefill of ``n_prompt`` tokens and ``steps`` single-token forwards."""
        from .. import decoding as dec

        vocab = int(getattr(lm.model.config, "vocab_size", 0) or 1000)
        ids = [(i * 37) % max(1, min(1000, vocab - 10)) + 5 for i in range(n_prompt + 1)]
        for _ in range(2):                       # the first pass warms the kernels and caches up; the second counts
            cache = dec.DynamicCache()
            t0 = time.perf_counter()
            dec.prefill(lm.model, ids[:n_prompt], cache)
            t1 = time.perf_counter()
            tok = ids[n_prompt]
            for _ in range(steps):
                tok = int(dec.decode_one(lm.model, tok, cache).argmax())
            t2 = time.perf_counter()
        return cls((t2 - t1) * 1e3 / steps, (t1 - t0) * 1e3 / n_prompt)

    def observe_round(self, forward_ms: float, forwards: int, fed: int) -> None:
        """One drafting round: ``forwards`` forwards, the first reading ``fed`` tokens."""
        if forwards > 0 and fed <= 2:
            self.d_ms += EMA * (forward_ms / forwards - self.d_ms)

    def observe_prefill(self, ms: float, tokens: int) -> None:
        if tokens >= 16:
            self.prefill_ms_tok += EMA * (ms / tokens - self.prefill_ms_tok)

    def as_dict(self) -> dict:
        return {"d_ms": round(self.d_ms, 3), "prefill_ms_tok": round(self.prefill_ms_tok, 4)}


PROBE = "def area(r):\n    return 3.14159 * r ** 2  # Hello, world! Grüße, 東京 42"


def same_tokenizer(draft_tok, target_tok) -> bool:
    """A draft proposes ids: they stand for the target's text only where both tokenizers split
    the same text into the same ids."""
    enc = lambda t: list(t(PROBE, add_special_tokens=False)["input_ids"])     # noqa: E731
    return enc(draft_tok) == enc(target_tok)


def target_tokenizer(spec):
    """The target's tokenizer: an object, or a folder / name transformers loads (vLLM's
    ``model_config.tokenizer``); None where there is none to compare."""
    if spec is None or not isinstance(spec, (str, os.PathLike)):
        return spec
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(spec))


def model_alpha(hits: float, trials: float, pooled: float) -> float:
    """A request's model-draft acceptance: its own judged drafts, shrunk toward the pooled rate."""
    return (hits + PRIOR_TRIALS * pooled) / (trials + PRIOR_TRIALS)


def remaining(produced: int) -> int:
    """Tokens a request is assumed to have left: as many as it has produced (vLLM does not tell a
    proposer its max_tokens; a request that ran g tokens is as likely as not to run g more)."""
    return max(REMAINING_MIN, produced)


def default_spec(calibrated: dict | None = None) -> tuple[str, str] | None:
    """The draft named in the environment (the engine's workers inherit it), else the one the
    profile was calibrated with (its ``draft`` entry), else None."""
    spec = os.environ.get(DRAFT_ENV, "").strip()
    if spec:
        return spec, os.environ.get(NUMERICS_ENV, "q8").strip() or "q8"
    if calibrated and calibrated.get("spec"):
        return str(calibrated["spec"]), str(calibrated.get("numerics") or "q8")
    return None
