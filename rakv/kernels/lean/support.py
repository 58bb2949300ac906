"""Which models the lean forward runs (``kind``, ``supported``) and what it reads of their config."""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.nn import functional as F

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
            "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Phi3ForCausalLM": "phi3", "GPT2LMHeadModel": "gpt2"}
ARCHS = tuple(a for a, f in FAMILIES.items() if f != "gpt2")
GPT2_ARCHS = ("GPT2LMHeadModel",)
GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "gelu_fast", "quick_gelu")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")      # rope types whose frequencies do not move with length
SEPARATE_QKV = ("llama", "qwen3", "gemma2", "gemma3")       # q, k, v and gate, up as separate linears (Phi-3 fuses them)


def kind(model: nn.Module) -> str:
    """Which lean forward fits ``model``'s architecture: "llama" (Llama, Mistral, Qwen2), "qwen3",
    "gemma2", "gemma3", "phi3" or "gpt2" ("" for none)."""
    return FAMILIES.get(type(model).__name__, "")


def supported(model: nn.Module) -> str | None:
    """Why the lean forward cannot run ``model`` (None: it can)."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    fam = kind(model)
    if cfg is None or not fam:
        return f"{name} (lean forward: {', '.join(ARCHS + GPT2_ARCHS)})"
    p = next(model.parameters())
    if p.device.type != "cpu":
        return f"device {p.device.type}"
    if fam == "gpt2":
        return _gpt2_unsupported(cfg)
    base = getattr(model, "model", None)
    rot = getattr(base, "rotary_emb", None)
    if rot is None or not hasattr(base, "layers"):
        return f"{name} without the usual layout (model.layers, model.rotary_emb)"
    types = rot.rope_type if isinstance(getattr(rot, "rope_type", None), dict) else {"": getattr(rot, "rope_type", "?")}
    for t in types.values():
        if t not in STATIC_ROPE:
            return f"rope type {t}"
    try:
        for inv, _ in _rope_sources(model).values():
            if 2 * inv.numel() != _head_dim(cfg) and fam != "phi3":
                return "partial rotary embedding"
    except AttributeError as e:
        return f"rotary embedding layout ({e})"
    L = base.layers[0]
    if _act_fn(L.mlp) is None:
        return f"activation {getattr(cfg, 'hidden_activation', None) or getattr(cfg, 'hidden_act', '?')}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp"
    if fam == "gemma3" and getattr(cfg, "attn_logit_softcapping", None) and \
            getattr(cfg, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        return f"attention {cfg._attn_implementation} with soft-capping"
    return None


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _rope_sources(model: nn.Module) -> dict:
    """{layer type or "": (inv_freq, attention scaling)} from the model's own rotary module (HF's
    frequencies, whatever rope type made them: default, linear, llama3 or yarn)."""
    rot = model.model.rotary_emb
    if isinstance(getattr(rot, "rope_type", None), dict):          # Gemma 3: one table per layer type
        return {t: (getattr(rot, f"{t}_inv_freq"), float(getattr(rot, f"{t}_attention_scaling")))
                for t in rot.rope_type}
    return {"": (rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)))}


def _act_fn(mlp: nn.Module):
    """The MLP's activation as a plain function (the same maths as its module), None if unknown."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    name = type(act).__name__
    if isinstance(act, nn.SiLU) or name == "SiLUActivation":
        return F.silu
    if name == "GELUTanh" and getattr(act, "act", None) is not None:
        fn = act.act
        if getattr(fn, "func", None) is F.gelu and getattr(fn, "keywords", {}) == {"approximate": "tanh"}:
            return fn
    if name == "GELUActivation" and getattr(act, "act", None) is F.gelu:
        return F.gelu
    if isinstance(act, nn.GELU):
        return partial(F.gelu, approximate=act.approximate)
    return None


def _gpt2_unsupported(cfg) -> str | None:
    act = getattr(cfg, "activation_function", "gelu_new")
    if act not in GPT2_ACTS:
        return f"activation {act}"
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(cfg, flag, False):
            return flag
    return None


def _windows(model: nn.Module) -> list:
    """Each layer's attention window as HF's mask has it (None: full causal): Mistral and Phi-3
    slide every layer when the config has a window; Qwen2, Qwen3 and Gemma the layers whose type
    is sliding_attention; Llama none."""
    cfg, layers = model.config, model.model.layers
    w = getattr(cfg, "sliding_window", None)
    name = type(model).__name__
    if name in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return [int(w) if w else None] * len(layers)
    if name == "LlamaForCausalLM" or not w:
        return [None] * len(layers)
    types = getattr(cfg, "layer_types", None) or []
    return [int(w) if i < len(types) and types[i] == "sliding_attention" else None for i in range(len(layers))]
