"""``--draft layers:L``: a layer-truncated self-draft, the target's first L decoder layers, its final
norm and LM head, sharing the target's weights (no copy)."""

from __future__ import annotations

import torch

from ..load.loaded import LoadedModel, ModelError
from ..load.numerics import _switches_of, attach_lean
from .model import ModelDraft


def make(target: LoadedModel, config, arg: str) -> ModelDraft:
    """The registry's ``layers:L``."""
    try:
        L = int(arg)
    except ValueError:
        raise ModelError(f"bad --draft {'layers:' + arg!r}: expected layers:L with an integer L") from None
    return ModelDraft(layers_copy(target, L))


def layers_copy(target: LoadedModel, L: int) -> LoadedModel:
    """A layer-truncated self-draft: the target's first L decoder layers, its final norm and LM
    head, sharing the target's weights (no copy). Cheap to draft with but weak (its
    acceptance: docs/results.md, layers:6): the analogue of a small draft where speculation does not pay."""
    import copy

    m = target.model
    path, layers = _decoder_layers(m)
    if not 1 <= L < len(layers):
        raise ModelError(f"--draft layers:L needs 1 <= L < {len(layers)} (the target's layers); got {L}")
    cfg = copy.deepcopy(m.config)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(cfg, name):
            setattr(cfg, name, L)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:L]
    new = _shallow(m, cfg)
    parent = new
    for name in path[:-1]:
        child = _shallow(getattr(parent, name), cfg)
        setattr(parent, name, child)
        parent = child
    setattr(parent, path[-1], torch.nn.ModuleList(list(layers)[:L]))
    lm = LoadedModel(name=f"{target.name}-layers{L}", model=new, tokenizer=target.tokenizer,
                     key=f"{target.key}:layers{L}", max_positions=target.max_positions, eos_ids=target.eos_ids)
    attach_lean(lm, bool(target.lean), like=target, switches=_switches_of(target))
    return lm


def _decoder_layers(model: torch.nn.Module) -> tuple[list[str], torch.nn.ModuleList]:
    """The path to (and the) ModuleList of decoder blocks: the longest one of config's layer count."""
    c = model.config
    n = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == n]
    if not found:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__} for a layers:L draft")
    name, mod = min(found, key=lambda x: x[0].count("."))
    return name.split("."), mod


def _shallow(mod: torch.nn.Module, cfg) -> torch.nn.Module:
    """A new module object sharing ``mod``'s parameters and children (own child table, own config)."""
    import copy

    new = copy.copy(mod)
    new._modules = mod._modules.copy()
    new._parameters = mod._parameters.copy()
    new._buffers = mod._buffers.copy()
    if hasattr(new, "config"):
        new.config = cfg
    return new
