"""Peer baselines run through transformers itself on the same models and prompts.

  hf:assist      ``model.generate(assistant_model=draft, do_sample=False)`` with the assistant's own
                 generation settings (transformers 5.x defaults: 20 tokens, constant schedule,
                 assistant_confidence_threshold 0.4); for ``--draft int8`` the assistant is the int8 model.
  hf:confidence  the same with the assistant's length set to K (max of --k-set) and its confidence
                 gate explicit: stop drafting below ``assistant_confidence_threshold`` (0.4; adapted
                 online only when scikit-learn is installed): transformers' counterpart of adaptive:gate.
  hf:lookup      ``model.generate(prompt_lookup_num_tokens=K, do_sample=False)`` (prompt lookup).
  llama.cpp      llama.cpp (``llama_cpp``, llama-cpp-python: the ``peers`` extra, never required) on a
                 GGUF of the target's weights given with ``--peer-gguf`` (e.g. an F32 one from llama.cpp's
                 ``convert_hf_to_gguf.py --outtype f32``): greedy (top_k 1), the same prompt ids, no draft.

TTFT is taken from a streamer: the time of the first ``put`` after the prompt's (llama.cpp: the
first token's arrival).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rakv.device import clock as now, model_device

PEERS = ("hf:assist", "hf:confidence", "hf:lookup", "llama.cpp")
DEFAULT_PEERS = ("hf:assist", "hf:confidence", "hf:lookup")   # llama.cpp only when asked for (--peer-gguf)
CONFIDENCE_THRESHOLD = 0.4      # transformers' default assistant_confidence_threshold


@dataclass
class PeerResult:
    output_ids: list[int]
    latency_ms: float
    ttft_ms: float


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


class LlamaCppPeer:
    """llama.cpp on a GGUF, loaded once per thread count (torch's, so both sides get the same cores)."""

    gguf: str | None = None
    _llm = None
    _threads = None

    @classmethod
    def configure(cls, gguf: str | None) -> None:
        cls.gguf, cls._llm, cls._threads = gguf, None, None

    @classmethod
    def available(cls) -> str | None:
        """Why the llama.cpp peer cannot run (None: it can)."""
        if not cls.gguf:
            return "the llama.cpp peer needs --peer-gguf FILE (a GGUF of the target's weights)"
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an import that fails on a missing shared library too
            return f"the llama.cpp peer needs llama-cpp-python (pip install 'rakv-explorer[peers]'): {e}"
        return None

    @classmethod
    def llm(cls):
        threads = torch.get_num_threads()
        if cls._llm is None or cls._threads != threads:
            from llama_cpp import Llama

            cls._llm = Llama(model_path=cls.gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, verbose=False)
            cls._threads = threads
        return cls._llm

    @classmethod
    def run(cls, target, ids, n: int) -> PeerResult:
        llm = cls.llm()
        eos = set(target.eos_ids)
        out: list[int] = []
        t0 = now()
        ttft = 0.0
        for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                ttft = (now() - t0) * 1e3
            out.append(int(tok))
            if tok in eos or len(out) >= n:
                break
        return PeerResult(out, (now() - t0) * 1e3, ttft)


def run_peer(name: str, target, draft_model, ids, n: int, lookup_k: int, sampling=None) -> PeerResult:
    """One peer execution; with ``sampling`` (not greedy) transformers samples, seeded by its seed."""
    if name == "llama.cpp":
        return LlamaCppPeer.run(target, ids, n)
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


def peer_available(name: str, draft) -> bool:
    """hf:assist and hf:confidence need a draft model (not ngram / none); llama.cpp its GGUF and module."""
    if name == "llama.cpp":
        return LlamaCppPeer.available() is None
    return name not in ("hf:assist", "hf:confidence") or getattr(draft, "has_model", False)
