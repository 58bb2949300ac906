"""Builders for tiny random GPT-2 / Llama / Mistral / Qwen2 models, a tiny offline byte-level BPE
tokenizer, and the exactness oracle: greedy decoding by transformers on an untouched copy of the model."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from rakv.bench.tiny import perturbed  # noqa: F401  (one copy of the noise recipe)
from rakv.load.loaded import LoadedModel
from rakv.load.numerics import wrap

VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "Speculative decoding drafts tokens and verifies them with the target model in one pass.",
    "Prefix caching reuses the key and value states of a prompt that was seen before.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12. alpha beta gamma delta epsilon zeta eta theta",
]


# Qwen2.5-Coder's fill-in-the-middle tokens (``tiny_tokenizer(fim=True)`` has them, as ids 2..7)
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@lru_cache(maxsize=3)
def _tokenizer_json(variant: int = 0, fim: bool = False) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<eos>", "<pad>"] + (FIM_TOKENS if fim else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = CORPUS if variant == 0 else [c[::-1] for c in CORPUS]   # variant 1: other merges/ids
    tok.train_from_iterator(corpus * 4, trainer)
    return tok.to_str()


# a small chat template (ChatML-like): a shared system prefix, the user turn, the generation prompt
CHAT_TEMPLATE = ("{{ '<pad>system: You answer briefly and exactly.\n' }}"
                 "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<eos>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def tiny_tokenizer(variant: int = 0, chat: bool = False, fim: bool = False) -> PreTrainedTokenizerFast:
    """The tiny tokenizer; ``chat=True`` gives it CHAT_TEMPLATE, ``fim=True`` FIM_TOKENS (a tokenizer
    of its own: its other ids differ from the plain one's)."""
    from tokenizers import Tokenizer

    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(variant, fim)),
                                eos_token="<eos>", pad_token="<pad>",
                                **({"additional_special_tokens": FIM_TOKENS} if fim else {}))
    if chat:
        t.chat_template = CHAT_TEMPLATE
    return t


ARCHS = ("gpt2", "llama", "mistral", "qwen2")
MISTRAL_WINDOW = 16


def make_model(arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64, eos: int | None = None,
               init: float = 0.4):
    """A tiny random model of ``arch`` (gpt2 | llama | mistral | qwen2), weights ~ N(0, init).

    ``eos``: the EOS id its config names. None: the config names none; ``wrap`` then takes the
    tokenizer's ``<eos>`` (id 0) as the EOS, as for a real model whose config lacks one, and
    ``oracle`` stops at the same ids as the engine (it reads them from the wrapped model)."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=hidden, n_layer=layers, n_head=4,
                         initializer_range=init, eos_token_id=eos, bos_token_id=0)
        m = GPT2LMHeadModel(cfg)
    else:
        common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=init, eos_token_id=eos, bos_token_id=0, tie_word_embeddings=False)
        if arch == "llama":
            m = LlamaForCausalLM(LlamaConfig(**common))
        elif arch == "mistral":        # a sliding window shorter than most prompts
            m = MistralForCausalLM(MistralConfig(**common, sliding_window=MISTRAL_WINDOW))
        elif arch == "qwen2":
            m = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
            with torch.no_grad():      # q, k, v carry biases: random ones, so they count
                for mod in m.modules():
                    if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                        mod.bias.normal_(0, init)
        else:
            raise ValueError(f"unknown tiny arch {arch!r}")
    m.eval()
    m.generation_config.eos_token_id = eos
    m.generation_config.pad_token_id = 1
    return m


# ----------------------------------------------------------------------------- the untouched reference
# ``wrap`` patches a model in place (packed linears, the lean forward, block codes). The exactness
# reference must not run on the kernels it judges: ``wrap_tiny`` keeps a deep copy of the model as it
# was before wrapping, and ``oracle`` decodes with that copy (HF's own forward, torch's own kernels).
@dataclass
class _Reference:
    model: torch.nn.Module                     # the untouched deep copy
    lm: "weakref.ref"                          # the wrapped LoadedModel (its EOS ids, read at call time)
    memo: dict = field(default_factory=dict)   # (prompt, n, eos) -> ids


_REFERENCES: "weakref.WeakKeyDictionary[torch.nn.Module, _Reference]" = weakref.WeakKeyDictionary()


def is_patched(model: torch.nn.Module) -> bool:
    """Does ``model`` run any of the project's kernels (packed linears, lean forward, block codes)?"""
    from rakv.backends import lean_of
    from rakv.kernels import fastpath

    return fastpath.is_enabled(model) or lean_of(model) is not None


def wrap_tiny(model: torch.nn.Module, tokenizer=None, name: str = "model", **kw) -> LoadedModel:
    """``rakv.load.numerics.wrap``, keeping an untouched deep copy of ``model`` for ``oracle`` first."""
    if is_patched(model):
        raise AssertionError("wrap_tiny needs the model before any patching (its copy is the reference)")
    pristine = copy.deepcopy(model)
    lm = wrap(model, tokenizer, name=name, **kw)
    _REFERENCES[model] = _Reference(pristine, weakref.ref(lm))
    return lm


def reference_model(model) -> torch.nn.Module:
    """The untouched model whose greedy decoding is the reference for ``model`` (a LoadedModel or a
    module): the copy ``wrap_tiny`` kept, or ``model`` itself when nothing patched it. A patched
    model without a kept copy, or one whose weights changed since, is refused."""
    m = model.model if isinstance(model, LoadedModel) else model
    ref = _REFERENCES.get(m)
    if ref is None:
        if is_patched(m):
            raise AssertionError("an exactness reference from a patched model: build it with tests.tiny "
                                 "(make_pair / wrap_tiny), or decode an untouched copy")
        return m
    now = m.state_dict()
    for name, t in ref.model.state_dict().items():
        if name not in now or not torch.equal(now[name], t):
            raise AssertionError(f"the wrapped model's {name} changed since wrap_tiny copied it")
    return ref.model


def _model_eos(model) -> frozenset:
    """The EOS ids the engine stops on for ``model``: its LoadedModel's (the wrapped one's, for a
    module ``wrap_tiny`` wrapped), else what the module's generation config names."""
    if isinstance(model, LoadedModel):
        return frozenset(model.eos_ids)
    ref = _REFERENCES.get(model)
    lm = ref.lm() if ref is not None else None
    if lm is not None:
        return frozenset(lm.eos_ids)
    e = model.generation_config.eos_token_id
    return frozenset([e] if isinstance(e, int) else (e or []))


def oracle(model, prompt_ids: list[int], n: int, eos=None) -> list[int]:
    """Target-only greedy decoding by transformers itself (``generate``) on the untouched model
    (``reference_model``): the exactness oracle. It stops after the first of ``eos`` (default: the
    EOS ids the engine stops on, ``LoadedModel.eos_ids`` of the wrapped model), EOS included."""
    ref_model = reference_model(model)
    eos = _model_eos(model) if eos is None else frozenset(eos)
    ref = _REFERENCES.get(model.model if isinstance(model, LoadedModel) else model)
    key = (tuple(prompt_ids), int(n), tuple(sorted(eos)))
    if ref is not None and key in ref.memo:
        return list(ref.memo[key])
    gc = copy.deepcopy(ref_model.generation_config)
    gc.eos_token_id = sorted(eos) or None
    gc.pad_token_id, gc.do_sample, gc.max_new_tokens = 1, False, n
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = ref_model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    ids = out[0, len(prompt_ids):].tolist()
    if ref is not None:
        ref.memo[key] = list(ids)
    return ids


def reference(model, prompt_ids: list[int], n: int, eos=None) -> tuple[list[int], str]:
    """(ids, stopped) of the reference decoding: stopped "eos" when it ended on an EOS id."""
    eos = _model_eos(model) if eos is None else frozenset(eos)
    ids = oracle(model, prompt_ids, n, eos)
    return ids, "eos" if ids and ids[-1] in eos else "max_new_tokens"


def assert_exact(end, model, prompt_ids: list[int], n: int, what=""):
    """The request's whole output and its stop reason are the reference's."""
    want = reference(model, prompt_ids, n)
    assert (end.output_ids, end.stopped) == want, (what, prompt_ids)


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` on ``model`` itself, whatever kernels it runs, stopping where
    its generation config says (to compare kernels with each other; the exactness reference is
    ``oracle``)."""
    x = torch.tensor([prompt_ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         pad_token_id=1)
    return out[0, len(prompt_ids):].tolist()


def hf_forward(model, ids, cache, keep=0):
    """HF's own forward (the torch backend, ``rakv.backends.TorchBackend``), whatever backend the
    model has chosen."""
    from rakv.backends import TorchBackend

    return TorchBackend(model).forward(ids, cache, keep)


# ----------------------------------------------------------------------------- pairs
FORWARDS = ("lean", "hf", "plain")


def _wrap_as(forward: str, model, tok, name: str, keep: bool) -> LoadedModel:
    """Wrap on one forward: "lean" (the process default: packed linears and the lean forward), "hf"
    (packed linears under HF's own forward: RAKV_LEAN=0), "plain" (no fast path: torch's kernels)."""
    import os

    w = wrap_tiny if keep else wrap
    if forward == "plain":
        return w(model, tok, name=name, fast=False)
    if forward == "hf":
        old = os.environ.get("RAKV_LEAN")
        os.environ["RAKV_LEAN"] = "0"
        try:
            return w(model, tok, name=name)
        finally:
            if old is None:
                del os.environ["RAKV_LEAN"]
            else:
                os.environ["RAKV_LEAN"] = old
    return w(model, tok, name=name)


def make_pair(arch: str = "llama", agreement: str = "mostly", eos: int | None = None, seed: int = 0,
              forward: str = "lean"):
    """(target, draft) LoadedModels. agreement: 'identical' | 'mostly' | 'disagree'; forward: see
    ``_wrap_as``. The target keeps an untouched copy for ``oracle``; ``eos="emitted"``: an EOS id this
    target emits mid-output (``pick_eos``)."""
    tok = tiny_tokenizer()
    t = make_model(arch, seed=seed, eos=None if eos == "emitted" else eos)
    if eos == "emitted":
        set_eos(t, pick_eos(t))
    if agreement == "identical":
        d = copy.deepcopy(t)
    elif agreement == "mostly":
        d = perturbed(t, 0.01)
    else:
        d = make_model(arch, seed=seed + 100, eos=None, layers=1)
        set_eos(d, t.generation_config.eos_token_id)
    return (_wrap_as(forward, t, tok, f"tiny-{arch}", keep=True),
            _wrap_as(forward, d, tok, f"tiny-{arch}-draft-{agreement}", keep=False))


# prompts for EOS fixtures: EOS_PROMPTS[0] stops on EOS mid-output, some other one runs to the end
EOS_PROMPTS = [list(range(30, 50)), list(range(5, 45)), [3, 4, 5] * 6, list(range(100, 120)) + [7, 8]]
EOS_N = 20


def set_eos(model, eos: int | None) -> None:
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos


def pick_eos(model, prompts=EOS_PROMPTS, n: int = EOS_N) -> int:
    """An EOS id the untouched ``model`` emits mid-output: first emitted at position 5..15 of
    ``prompts[0]``'s greedy output, and absent from the output of another prompt (which then runs to
    ``n``)."""
    outs = [hf_greedy(model, p, n) for p in prompts]
    for j in range(5, 16):
        tok = outs[0][j]
        if tok not in outs[0][:j] and any(tok not in o for o in outs[1:]):
            return tok
    raise AssertionError("no token of this tiny target suits as a mid-output EOS")


def synthetic_profile(V=None, d=0.3, alpha0=0.7):
    """A synthetic cost profile that does not learn this machine's real (tiny-model) costs online, so
    the controller and the gate decide on the costs given here however fast this machine runs."""
    from rakv.decide.profile import CostProfile

    V = V or {str(k): 1.0 + 0.02 * k for k in range(1, 9)}
    p = CostProfile(T_pf=[[8, 1.0], [64, 4.0]], D_pf=[[8, 0.5], [64, 1.0]], t=[[16, 1.0], [256, 1.0]],
                    d=[[16, d], [256, d]], V=V, alpha0=alpha0)
    p.observe = lambda *a, **kw: None
    return p


def save_tiny(path, arch: str = "llama", seed: int = 0, tokenizer_variant: int = 0, draft_of=None,
              chat: bool = False, fim: bool = False):
    """Write a tiny model + tokenizer to ``path`` (a local dir the CLI can load); ``chat``: with a
    chat template; ``fim``: a tokenizer with FIM tokens."""
    import copy as _copy

    m = make_model(arch, seed=seed) if draft_of is None else perturbed(_copy.deepcopy(draft_of), 0.01)
    m.save_pretrained(path)
    tiny_tokenizer(tokenizer_variant, chat=chat, fim=fim).save_pretrained(path)
    return m


def snap_to_blocks(model, kind: str = "q4", head: str = "q8"):
    """Round every linear weight of ``model`` in place as llama.cpp's quantizers do, blocks of 32
    inputs: ``q4`` like Q4_1 (d = (max - min) / 15 and m = min as float16, q = round((w - m) / d)),
    ``q8`` like Q8_0 (d = max |w| / 127 as float16); the LM head by ``head``. The model then holds
    exactly what a GGUF of that type dequantizes to (what rakv.kernels.blockq runs from its codes)."""
    from transformers.pytorch_utils import Conv1D

    def q4(w):
        b = w.reshape(-1, 32)
        lo, hi = b.min(1, keepdim=True).values, b.max(1, keepdim=True).values
        d = ((hi - lo) / 15).half().float()
        m = lo.half().float()
        q = torch.round((b - m) / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 15)
        return (d * q + m).reshape(w.shape)

    def q8(w):
        b = w.reshape(-1, 32)
        d = (b.abs().max(1, keepdim=True).values / 127).half().float()
        q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d))).clamp(-128, 127)
        return (d * q).reshape(w.shape)

    head_mod = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (torch.nn.Linear, Conv1D)) or type(mod).__name__ == "FastLinear":
                w = mod.weight
                mat = w.t() if isinstance(mod, Conv1D) or getattr(mod, "transposed", False) else w
                snapped = (q8 if (mod is head_mod and head == "q8") or kind == "q8" else q4)(mat.contiguous())
                w.copy_(snapped.t() if mat is not w else snapped)
    return model
