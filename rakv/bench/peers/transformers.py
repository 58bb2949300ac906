"""The transformers peer: baselines run through transformers itself on the same models and prompts.

  hf:assist      ``model.generate(assistant_model=draft, do_sample=False)`` with the assistant's own
                 generation settings (transformers 5.x defaults: 20 tokens, constant schedule,
                 assistant_confidence_threshold 0.4); for ``--draft int8`` the assistant is the int8 model.
  hf:confidence  the same with the assistant's length set to K (max of --k-set) and its confidence
                 gate explicit: stop drafting below ``assistant_confidence_threshold`` (0.4; adapted
                 online only when scikit-learn is installed): transformers' counterpart of adaptive:gate.
  hf:lookup      ``model.generate(prompt_lookup_num_tokens=K, do_sample=False)`` (prompt lookup).

TTFT is taken from a streamer: the time of the first ``put`` after the prompt's. In the default set
with --peers (hf:assist and hf:confidence only with a draft model; none with --draft none).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Peer, ids_row

ARMS = ("hf:assist", "hf:confidence", "hf:lookup")
NEEDS_DRAFT_MODEL = ("hf:assist", "hf:confidence")
CONFIDENCE_THRESHOLD = 0.4      # transformers' default assistant_confidence_threshold


@dataclass
class PeerResult:
    output_ids: list[int]
    latency_ms: float
    ttft_ms: float


def now() -> float:
    from rakv.util.device import clock

    return clock()


class FirstTokenTimer:
    """A minimal streamer: records when the first generated tokens arrive."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.calls = 0
        self.ttft_ms = 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.ttft_ms = (now() - self.t0) * 1e3

    def end(self) -> None:
        pass


def generate_kwargs(target, n: int, sampling=None) -> dict:
    """``n`` new tokens at most, the engine's EOS set; greedy, or transformers' own sampling at the
    same temperature and filters (``do_sample=True``: its tokens are its generator's, not ours)."""
    eos = sorted(target.eos_ids) or None
    gc = target.model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    kw = dict(do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
    if sampling is not None and not sampling.greedy:
        kw.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                  top_p=sampling.top_p, min_p=sampling.min_p or None)
    return kw


def run_peer(name: str, target, draft_model, ids, n: int, lookup_k: int, sampling=None) -> PeerResult:
    """One transformers execution; with ``sampling`` (not greedy) transformers samples, seeded by its seed."""
    import torch

    from rakv.util.device import model_device

    x = torch.tensor([list(ids)], device=model_device(target.model))
    kw = generate_kwargs(target, n, sampling)
    if sampling is not None and not sampling.greedy:
        torch.manual_seed(sampling.seed % 2**63)
    saved = None
    if name in ("hf:assist", "hf:confidence"):
        kw["assistant_model"] = draft_model
        if name == "hf:confidence":
            gc = draft_model.generation_config
            saved = {a: getattr(gc, a, None) for a in
                     ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = lookup_k, "constant"
            gc.assistant_confidence_threshold = CONFIDENCE_THRESHOLD
    elif name == "hf:lookup":
        kw["prompt_lookup_num_tokens"] = lookup_k
    else:
        raise ValueError(f"unknown peer {name!r}")
    t0 = now()
    timer = FirstTokenTimer(t0)
    try:
        with torch.inference_mode():
            out = target.model.generate(x, attention_mask=torch.ones_like(x), streamer=timer, **kw)
    finally:
        for a, v in (saved or {}).items():
            setattr(draft_model.generation_config, a, v)
    latency = (now() - t0) * 1e3
    return PeerResult(out[0, x.shape[1]:].tolist(), latency, timer.ttft_ms or latency)


class TransformersPeer(Peer):
    name = "transformers"
    arm_names = ARMS

    def add_args(self, ap) -> None:
        import argparse

        ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                        help="include the transformers peers (hf:assist, hf:confidence, hf:lookup)")

    def why_not(self, arm: str, draft) -> str | None:
        if arm in NEEDS_DRAFT_MODEL and not getattr(draft, "has_model", False):
            return f"peer {arm} needs a draft model (--draft is {getattr(draft, 'name', 'none')!r})"
        return None

    def default_arms(self, draft) -> list[str]:
        if getattr(draft, "name", "none") == "none":
            return []
        return [a for a in ARMS if self.why_not(a, draft) is None]

    def run(self, arm: str, req, ctx) -> dict:
        dm = ctx.draft.lm.model if getattr(ctx.draft, "has_model", False) else None
        sampling = ctx.config.sampling
        s = None if sampling is None or sampling.greedy else sampling.for_request(req.index)
        res = run_peer(arm, ctx.target, dm, req.ids, req.gen, ctx.lookup_k, s)
        return ids_row(res.output_ids, res.latency_ms, res.ttft_ms, req.gen)
