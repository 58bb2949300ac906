"""GGUF files: converted once into the cache dir (``ensure_gguf``, ``convert_gguf``): straight from
the file where it can (``_convert_direct``), else through transformers' GGUF loader (``_load_gguf``)
with the file's own block codes matched back to the dequantized linears (``gguf_codes``)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..util.paths import cache_dir, log
from .loaded import ModelError, check_all_loaded
from .slim import (_converted_ready, _ensure_converted, _ino, _note_failed, _save_converted,
                   _slim_state, file_hash)


def convert_gguf(gguf: Path, out: Path, source: dict | None = None, damaged: int | None = None) -> None:
    """Convert ``gguf`` into the folder ``out`` once, atomically (see above): straight from the file
    (``_convert_direct``: its codes as they are, the other tensors in float32, tensor by tensor),
    else, for a file that path does not cover, through transformers' GGUF loader (every tensor
    dequantized to float32 at once, then the codes matched back). ``source``: what to record about
    the file in the marker; ``damaged``: see ``_install``."""
    t0 = time.perf_counter()
    log(f"converting {gguf.name} (one time; later runs load the converted copy) ...")
    try:
        direct = _convert_direct(gguf)
    except Exception as e:  # noqa: BLE001 - any gap in the direct path: transformers' loader converts it
        log(f"converting it through transformers' GGUF loader instead ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})")
        direct = None
    if direct is not None:
        model, tok, codes = direct
        _save_checked(gguf, out, model, tok, codes, source, t0, damaged)
        return
    model, tok = _load_gguf(gguf)
    codes = gguf_codes(gguf, model)
    _save_checked(gguf, out, model, tok, codes, source, t0, damaged)


def _save_checked(gguf: Path, out: Path, model, tok, codes: dict, source: dict | None, t0: float,
                  damaged: int | None) -> None:
    log(f"saving the converted model into {out} ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent))
    try:
        _save_converted(tmp, out, model, tok, codes, gguf, source, t0, damaged)
    except Exception as e:  # noqa: BLE001 - a full disk (safetensors' own error type too): one line, nothing kept
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _note_failed(out, why)
        raise ModelError(f"cannot save the converted {gguf.name} into {out.parent}: {why}; nothing was kept, "
                         "the next run converts it again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _note_failed(out, None)
    log(f"{gguf.name} converted in {time.perf_counter() - t0:.1f} s")


class _Direct(Exception):
    """A GGUF the direct conversion does not cover (transformers' loader converts it instead)."""


CHECK_ROWS = 64        # rows of each coded tensor checked against the gguf package's own dequantization


def _convert_direct(gguf: Path):
    """(model, tokenizer, codes) for a slim copy of ``gguf`` read straight from the file: the
    architecture from its metadata (transformers' GGUF config and tokenizer readers), each linear
    layer's and the token table's codes as the file holds them (``blockq.from_gguf``; rows reordered
    where transformers' tensor processor reorders them, as for Llama's q and k), every other tensor
    dequantized and processed as transformers' loader would, one at a time: no float32 copy of the
    coded weights, memory about the file's size. The model's coded weights are left on the meta
    device (the slim copy does not hold them). Raises ``_Direct`` where the file needs more
    (a processor that reshapes a linear's rows, a tensor of another kind, a layer left without one)."""
    import gguf as G
    import numpy as np
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from ..kernels import blockq

    with _gguf_read_once():                   # the file's header parsed once (G.GGUFReader is shared)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        reader = G.GGUFReader(str(gguf))
        parsed = {"config": config.to_dict()}
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        for attr in ("quantization_config",):
            if hasattr(config, attr):
                try:
                    delattr(config, attr)
                except AttributeError:
                    setattr(config, attr, None)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed.get("config", {}))
        names = get_gguf_hf_weights_map(model, processor)
    mods = dict(model.named_modules())
    codes: dict = {}
    rest: dict = {}
    for t in reader.tensors:
        qtype = getattr(t.tensor_type, "name", "")
        shape = [int(x) for x in reversed(t.shape)]            # numpy order: [N, K] for a matrix
        mod = None
        probe = processor.process(weights=np.zeros(shape[:1] + [1] * (len(shape) > 1), dtype=np.float32), name=t.name,
                                  tensor_key_mapping=names, parsed_parameters=parsed)
        if probe.name not in names:
            continue                                           # as transformers' loader: not the model's
        hf = names[probe.name]
        mname, _, leaf = hf.rpartition(".")
        mod = mods.get(mname)
        coded = (leaf == "weight" and len(shape) == 2 and qtype in blockq.GGUF_BLOCK
                 and type(mod) in (torch.nn.Linear, torch.nn.Embedding))
        if coded:
            N, K = shape
            b = blockq.from_gguf(t.data, qtype, N, K)
            if b is None:
                raise _Direct(f"{t.name}: {qtype} codes the kernel does not run")
            rows = processor.process(weights=np.arange(N, dtype=np.float32).reshape(N, 1), name=t.name,
                                     tensor_key_mapping=names, parsed_parameters=parsed).weights
            rows = np.asarray(rows)
            if rows.shape != (N, 1) or sorted(rows[:, 0].astype(np.int64).tolist()) != list(range(N)):
                raise _Direct(f"{t.name}: its rows are reshaped, not reordered")
            order = rows[:, 0].astype(np.int64).tolist()
            if order != list(range(N)):
                b = b.rows(order)
            n = min(N, CHECK_ROWS)            # the codes against the gguf package's values of those rows
            raw = np.asarray(t.data).reshape(N, -1)
            want = dequantize(raw[order[:n]], t.tensor_type).reshape(n, K)
            if not torch.equal(b.rows(list(range(n))).dequantize(), torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))):
                raise _Direct(f"{t.name}: its codes do not rebuild the file's values")
            codes[mname] = b
            continue
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        w = processor.process(weights=w, name=t.name, tensor_key_mapping=names, parsed_parameters=parsed).weights
        rest[hf] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    model.load_state_dict(rest, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        ename = next((n for n, m in mods.items() if m is emb), None)
        hname = next((n for n, m in mods.items() if m is head), None)
        if ename in codes and hname and hname not in codes:
            codes[hname] = codes[ename]                         # one table, both ends (tied)
    left = [n for n, p in model.named_parameters() if p.is_meta and n.rpartition(".")[0] not in codes]
    left += [n for n, t in _slim_state(model, codes).items() if t.is_meta]
    if left:
        raise _Direct(f"no tensor in the file for {left[0]}")
    model.generation_config = GenerationConfig.from_model_config(config)
    model.eval()
    return model, tok, codes


def gguf_codes(gguf: Path, model: torch.nn.Module) -> dict:
    """The GGUF's own block codes for every linear layer of ``model`` (its dequantized weights) that
    they rebuild bit for bit: {module name: BlockWeight}. A tensor is matched to a layer by its
    rows' contents (a fingerprint of each row's bits), so the loader's renaming and row
    permutations (Llama's q / k) need no table; the match is then checked element by element.
    Nothing when the gguf package or the file's tensors cannot be read."""
    from ..kernels import blockq

    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
    except Exception:  # noqa: BLE001 - no codes, the fp32 weights stand
        return {}
    from ..kernels.fastpath import FastLinear

    # the linears, and the token table (a plain nn.Embedding: its rows are a linear's, [V, H] = [N, K])
    layers = {n: (blockq._matrix(m) if isinstance(m, FastLinear) else m.weight.detach())
              for n, m in model.named_modules()
              if (isinstance(m, (torch.nn.Linear, FastLinear)) or type(m) is torch.nn.Embedding)
              and m.weight.dtype == torch.float32}
    keys: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def prints(w: torch.Tensor) -> torch.Tensor:          # [N] int64: one fingerprint a row
        K = int(w.shape[1])
        if K not in keys:
            keys[K] = torch.randint(-(2 ** 62), 2 ** 62, (K,), generator=gen, dtype=torch.int64)
        # of the values (+ 0.0: -0.0 and 0.0 are one value, as the codes' check compares)
        return torch.cat([((w[i: i + 1024] + 0.0).view(torch.int32).to(torch.int64) * keys[K]).sum(1)
                          for i in range(0, w.shape[0], 1024)])

    want: dict = {}
    rows_of = {}
    for name, w in layers.items():
        rows_of[name] = p = prints(w)
        want.setdefault((tuple(w.shape), int(p.sum())), []).append(name)
    out: dict = {}
    for t in reader.tensors:
        qtype = getattr(t.tensor_type, "name", "")
        if qtype not in blockq.GGUF_BLOCK or len(t.shape) != 2:
            continue
        K, N = int(t.shape[0]), int(t.shape[1])
        try:
            b = blockq.from_gguf(t.data, qtype, N, K)
        except (ValueError, TypeError):
            b = None
        if b is None:
            continue
        p = prints(b.dequantize())
        names = [n for n in want.get(((N, K), int(p.sum())), []) if n not in out]
        if not names:
            continue
        where = {v: i for i, v in enumerate(p.tolist())}
        for name in names:
            order = [where.get(v) for v in rows_of[name].tolist()]
            if None in order:
                continue
            c = b if order == list(range(N)) else b.rows(order)
            if c.rebuilds(layers[name]):
                out[name] = c
    tables = {n for n, m in model.named_modules() if type(m) is torch.nn.Embedding}
    lin = [n for n in out if n not in tables]
    if out:
        log(f"{len(lin)} of {len(set(layers) - tables)} linear layers keep the GGUF's codes "
            f"({', '.join(sorted({b.kind for b in out.values()}))})"
            + (", and the token table" if set(out) & tables else ""))
    return out


def ensure_gguf(gguf: Path, damaged: int | None = None) -> tuple[Path, str]:
    """The converted copy of ``gguf`` (converting it the first time) and the file's content hash.
    ``damaged``: the inode of a converted folder that failed to load: converted again, unless
    another process has replaced that folder meanwhile."""
    digest = file_hash(gguf)
    out = cache_dir() / "models" / f"gguf-{digest}"

    def ready(o: Path) -> bool:
        return _converted_ready(o) and (damaged is None or _ino(o) != damaged)

    _ensure_converted(out, ready, lambda o: convert_gguf(gguf, o, {"blake2b": digest}, damaged=damaged), gguf.name)
    return out, digest


_GGUF_PATCH = threading.RLock()


@contextlib.contextmanager
def _gguf_read_once():
    """While converting: one ``GGUFReader`` per file and one tensor-name map per (arch, layers).
    transformers' loader parses the file's header (the whole vocabulary, in Python) three times
    (config, weights, tokenizer) and builds the name map once per module (~400 times on a small
    model): most of a conversion's time. Both are pure functions of their arguments here.

    The patch is the ``gguf`` module's, so one conversion at a time holds it (``_GGUF_PATCH``): two
    threads nesting it would restore each other's patch and leave a reader cache that outlives its
    conversion (a file rewritten at the same path would then be read as it was)."""
    try:
        import gguf as G
    except ImportError:
        yield
        return
    with _GGUF_PATCH:
        reader, name_map = G.GGUFReader, G.get_tensor_name_map
        readers: dict = {}

        def one_reader(path, mode="r"):
            st = os.stat(path)
            key = (os.path.realpath(str(path)), mode, st.st_size, st.st_mtime_ns, st.st_ino)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        G.GGUFReader, G.get_tensor_name_map = one_reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            G.GGUFReader, G.get_tensor_name_map = reader, name_map
            readers.clear()


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_read_once():
            model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32, output_loading_info=True)
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
