"""Builders for tiny random GPT-2 / Llama models and a tiny offline byte-level BPE tokenizer."""

from __future__ import annotations

import copy
from functools import lru_cache

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rakv.bench.tiny import perturbed  # noqa: F401  (one copy of the noise recipe)
from rakv.models import wrap

VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "Speculative decoding drafts tokens and verifies them with the target model in one pass.",
    "Prefix caching reuses the key and value states of a prompt that was seen before.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12. alpha beta gamma delta epsilon zeta eta theta",
]


@lru_cache(maxsize=2)
def _tokenizer_json(variant: int = 0) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = CORPUS if variant == 0 else [c[::-1] for c in CORPUS]   # variant 1: other merges/ids
    tok.train_from_iterator(corpus * 4, trainer)
    return tok.to_str()


# a small chat template (ChatML-like): a shared system prefix, the user turn, the generation prompt
CHAT_TEMPLATE = ("{{ '<pad>system: You answer briefly and exactly.\n' }}"
                 "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<eos>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def tiny_tokenizer(variant: int = 0, chat: bool = False) -> PreTrainedTokenizerFast:
    """The tiny tokenizer; ``chat=True`` gives it CHAT_TEMPLATE."""
    from tokenizers import Tokenizer

    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(variant)),
                                eos_token="<eos>", pad_token="<pad>")
    if chat:
        t.chat_template = CHAT_TEMPLATE
    return t


def make_model(arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64, eos: int | None = None,
               init: float = 0.4):
    torch.manual_seed(seed)
    # eos None: no EOS token at all (output runs to max_new_tokens)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=hidden, n_layer=layers, n_head=4,
                         initializer_range=init, eos_token_id=eos, bos_token_id=0)
        m = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, initializer_range=init, eos_token_id=eos,
                          bos_token_id=0, tie_word_embeddings=False)
        m = LlamaForCausalLM(cfg)
    m.eval()
    m.generation_config.eos_token_id = eos
    m.generation_config.pad_token_id = 1
    return m


def make_pair(arch: str = "llama", agreement: str = "mostly", eos: int | None = None, seed: int = 0):
    """(target, draft) LoadedModels. agreement: 'identical' | 'mostly' | 'disagree'."""
    tok = tiny_tokenizer()
    t = make_model(arch, seed=seed, eos=eos)
    if agreement == "identical":
        d = copy.deepcopy(t)
    elif agreement == "mostly":
        d = perturbed(t, 0.01)
    else:
        d = make_model(arch, seed=seed + 100, eos=eos, layers=1)
    return wrap(t, tok, name=f"tiny-{arch}"), wrap(d, tok, name=f"tiny-{arch}-draft-{agreement}")


def oracle(model, prompt_ids: list[int], n: int) -> list[int]:
    """Target-only greedy decoding by transformers itself (the exactness oracle)."""
    x = torch.tensor([prompt_ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         pad_token_id=1)
    return out[0, len(prompt_ids):].tolist()


def save_tiny(path, arch: str = "llama", seed: int = 0, tokenizer_variant: int = 0, draft_of=None,
              chat: bool = False):
    """Write a tiny model + tokenizer to ``path`` (a local dir the CLI can load); ``chat``: with a
    chat template."""
    import copy as _copy

    m = make_model(arch, seed=seed) if draft_of is None else perturbed(_copy.deepcopy(draft_of), 0.01)
    m.save_pretrained(path)
    tiny_tokenizer(tokenizer_variant, chat=chat).save_pretrained(path)
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
