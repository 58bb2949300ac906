"""The loaded model (``LoadedModel``), the loader's one error (``ModelError``), and what is read off
a loaded model (its key's weights hash, ``model_info``, ``backend_name``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


class ModelError(RuntimeError):
    """A model could not be loaded or a pair is not usable; the message is one clear line."""


@dataclass
class LoadedModel:
    """A causal LM ready for our own decode loop."""

    name: str
    model: torch.nn.Module
    tokenizer: object | None
    key: str                          # model key: id @ revision-or-hash : dtype
    max_positions: int | None
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    fast: bool = False                # the packed oneDNN forward path is engaged (rakv.kernels.fastpath)
    lean: str = ""                    # the lean forward (rakv.kernels.lean) runs it: "" when not, else its kind
    fast_reason: str = ""             # why not, when it was asked for and could not apply
    one_row: dict = field(default_factory=dict)   # the one-row kernel chosen on the fast path, and how
    blockq: dict = field(default_factory=dict)    # exact block-coded weights in use (rakv.kernels.blockq.attach)
    codes_file: str = ""             # codes read from the model's GGUF at conversion (offered to blockq.attach)
    numerics: str = "fp32"           # the linears' arithmetic: "fp32" or "q8" (``set_numerics``)
    slim: bool = False               # loaded from a slim converted GGUF: its coded linears' fp32 weights are made
                                     # from the codes only when fp32 arithmetic needs them (``_materialize``)
    narrow: str = ""                 # "q4": a draft's wider codes requantized to Q4_1 (``narrow_draft``)
    backend: object = field(default=None, repr=False, compare=False)   # what runs its forward (rakv.backends),
                                     # chosen at load by ``select_backend`` (``set_fast`` calls it last)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0]) if hasattr(
            self.model.get_output_embeddings(), "weight") else int(self.model.config.vocab_size)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers (from the config, not guessed)."""
        c = self.model.config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer")
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head")
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd")
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        elt = torch.finfo(_dtype_of(self.model)).bits // 8
        return 2 * layers * kv_heads * head_dim * elt


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def weights_hash(model: torch.nn.Module) -> str:
    """A cheap content hash: shapes plus a sample of every parameter's values."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        if p.is_floating_point():
            flat = p.detach().reshape(-1)
            h.update(flat[:: max(1, flat.numel() // 64)][:64].float().numpy().tobytes())
    return h.hexdigest()


def check_all_loaded(info: dict, what: str) -> None:
    """Refuse a model some of whose weights were not in the checkpoint (they would be random)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelError(f"{what} lacks {len(missing)} weight tensor(s) (e.g. {missing[0]}); refusing a model "
                         "that would be partly random")


def backend_name(lm: LoadedModel) -> str:
    """The name of what runs ``lm``'s forward (``rakv.backends``): torch | lean-fp32 | lean-q8."""
    from ..backends import backend_of

    be = getattr(lm, "backend", None)
    if be is None and getattr(lm, "model", None) is not None:
        be = backend_of(lm.model)
    return be.name if be is not None else ""


def model_info(lm: LoadedModel) -> dict:
    c = lm.model.config
    n_params = sum(p.numel() for p in lm.model.parameters())
    dev = next(lm.model.parameters()).device
    return {"name": lm.name, "key": lm.key, "arch": type(lm.model).__name__, "params": n_params,
            "numerics": lm.numerics,
            "layers": getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None),
            "max_positions": lm.max_positions, "device": str(dev), "fast": lm.fast, "lean": bool(lm.lean),
            "backend": backend_name(lm),
            **({"fast_reason": lm.fast_reason} if lm.fast_reason else {}),
            **({"one_row_kernel": lm.one_row.get("kernel", "")} if lm.one_row else {}),
            **({"block_layers": lm.blockq["layers"], "block_kinds": lm.blockq["kinds"],
                "block_mib": round(lm.blockq["bytes"] / 2**20, 1)} if lm.blockq.get("layers") else {})}
