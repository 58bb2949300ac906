"""Tiny random models for the hidden ``--tiny`` bench (CI): a byte-level BPE tokenizer trained on
a few lines, a 2-layer Llama target, and a slightly perturbed copy as the draft. Seconds, offline."""

from __future__ import annotations

import copy

import torch

VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "Here is a numbered list:\n1. apple banana\n2. cherry delta\n3. echo falcon\n",
    "| name | value | tag |\n|---|---|---|\n| river | 12 | silver |\n",
    "Question: What is the main topic of the text above?\nAnswer: Continue the list above.",
]


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.4, eos_token_id=None, bos_token_id=0, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 1
    return m


def perturbed(m, scale: float = 0.01, seed: int = 1):
    d = copy.deepcopy(m)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return d


def make_pair(draft_spec: str):
    """(target LoadedModel, DraftSource): int8 / ngram / none as usual, anything else the perturbed copy."""
    from rakv.config import RakvConfig
    from rakv.drafts.model import ModelDraft
    from rakv.drafts.registry import make_draft
    from rakv.load.numerics import wrap

    tok = tokenizer()
    t = model()
    target = wrap(t, tok, name="tiny-llama")
    if draft_spec in ("int8", "ngram", "none"):
        return target, make_draft(draft_spec, target, RakvConfig())
    return target, ModelDraft(wrap(perturbed(t), tok, name="tiny-llama-draft"))
