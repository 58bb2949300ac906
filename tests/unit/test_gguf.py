"""A ``.gguf`` is converted once into the cache dir (keyed by the file's content hash) and loaded
from the converted copy afterwards, with the same weights and ids; concurrent first uses convert
once and never leave a damaged copy. The GGUF is a tiny random Llama written here with the
``gguf`` package, no network."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import rakv.load.gguf as LG
import rakv.load.hub as LH
import rakv.load.loaded as LL
import rakv.load.slim as LS

from tests.tiny import make_model, oracle, tiny_tokenizer

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own cache dir: what one converted must not be found by the next."""
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q / k rows (rotate-half -> interleaved pairs);
    transformers' GGUF loader undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0, scale: float = 0.002) -> np.ndarray:
    """Random raw blocks of a GGUF type [rows, row bytes] (gguf.quants has no K-quant quantizer): random
    codes and sub-scales, the float16 super-block scales set to about ``scale``."""
    bs, ts = gguf.constants.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * cols // bs, ts), dtype=np.uint8)
    at = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
          "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0]}[qtype]
    for i in at:
        b[:, i:i + 2] = (rng.uniform(0.5, 1.5, (b.shape[0], 1)) * scale).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def write_llama_gguf(path: Path, model, qtype: str = "F32", qtypes: dict | None = None,
                     add_bos: bool | None = None, chat_template: str | None = None, settled: bool = True) -> None:
    """Write the tiny Llama ``model`` (tests/tiny.py make_model) and the tiny tokenizer as a GGUF,
    the linear weights as ``qtype`` (F32, or a block type such as Q8_0 quantized by gguf.quants),
    norms F32, as llama.cpp's converter names and lays them out. ``qtypes``: a GGUF type per tensor
    role (attn_q, attn_v, ffn_down, output, ...) written as random raw blocks of that type instead
    (the model is then what the file says: load it with transformers). ``settled``: stamped a minute
    ago, so its hash is remembered (see ``settle``)."""
    cfg = model.config
    js = json.loads(tiny_tokenizer().backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(js["model"]["vocab"].items(), key=lambda x: x[1])]
    types = [1] * len(tokens) + [5] * (cfg.vocab_size - len(tokens))     # the model's rows past the vocab: unused
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         else float(cfg.rope_theta))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in js["model"]["merges"]])
    w.add_eos_token_id(0)
    w.add_bos_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    q = getattr(gguf.GGMLQuantizationType, qtype)

    def put(name: str, arr: np.ndarray, quantize: bool = True) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        role = name.split(".")[-2]
        if quantize and qtypes and role in qtypes:
            t = getattr(gguf.GGMLQuantizationType, qtypes[role])
            w.add_tensor(name, random_blocks(qtypes[role], *arr.shape, seed=zlib.crc32(name.encode())), raw_dtype=t)
        elif quantize and q != gguf.GGMLQuantizationType.F32 and arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)      # bytes [rows, row bytes]
        else:
            w.add_tensor(name, arr)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], False)
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], False)
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"], False)
    put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if settled:
        settle(path)


def _tiny_gguf(dirpath: Path, qtype: str = "F32", seed: int = 0) -> tuple[Path, torch.nn.Module]:
    m = make_model("llama", seed=seed, hidden=64)
    dirpath.mkdir(parents=True, exist_ok=True)
    f = dirpath / f"tiny-{qtype.lower()}-{seed}.gguf"
    write_llama_gguf(f, m, qtype)
    return f, m


def settle(f: Path) -> None:
    """Stamp ``f`` a minute ago: a hash of it is then remembered (one written just now is racy)."""
    t = time.time_ns() - 60_000_000_000
    os.utime(f, ns=(t, t))


def _hf_gguf(f: Path):
    """transformers' own GGUF loader on the file (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32).eval()


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _count_conversions(monkeypatch) -> list:
    calls = []
    real = LG.convert_gguf

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(LG, "convert_gguf", counted)
    return calls


PROMPT = [(7 * i + 3) % 300 for i in range(12)]


@pytest.mark.fast
def test_the_tiny_gguf_is_the_model_for_transformers(tmp_path):
    f, m = _tiny_gguf(tmp_path)
    _same_weights(_hf_gguf(f), m)          # the writer lays it out as llama.cpp's converter does


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_is_converted_once_and_loads_the_same(tmp_path, monkeypatch, qtype, capsys):
    f, m = _tiny_gguf(tmp_path / "src", qtype)
    calls = _count_conversions(monkeypatch)
    first = LH.load_model(str(f), fast=False)
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert "converting" in err and "converted" in err
    folder = LS.cache_dir() / "models" / f"gguf-{LS.file_hash(f)}"
    assert (folder / LS.CONVERTED_MARK).is_file() and list(folder.glob("*.safetensors"))

    second = LH.load_model(str(f), fast=False)
    assert len(calls) == 1                                  # not converted again
    assert "converting" not in capsys.readouterr().err
    assert first.key == second.key and "gguf-" in first.key
    ref = _hf_gguf(f)
    _same_weights(first.model, ref)
    _same_weights(second.model, ref)
    if qtype == "F32":
        _same_weights(second.model, m)
    want = oracle(ref, PROMPT, 12)
    assert oracle(first.model, PROMPT, 12) == want == oracle(second.model, PROMPT, 12)
    vocab = second.tokenizer.get_vocab()
    assert all(vocab.get(t) == i for t, i in tiny_tokenizer().get_vocab().items())


def test_a_moved_copy_finds_the_conversion_and_a_changed_file_does_not(tmp_path, monkeypatch):
    f, _ = _tiny_gguf(tmp_path / "a")
    calls = _count_conversions(monkeypatch)
    a = LH.load_model(str(f), fast=False)
    (tmp_path / "b").mkdir()
    g = tmp_path / "b" / "renamed.gguf"
    shutil.copy(f, g)
    b = LH.load_model(str(g), fast=False)
    assert len(calls) == 1 and a.key.split("@")[1] == b.key.split("@")[1]     # same content, same copy
    f2, _ = _tiny_gguf(tmp_path / "c", seed=3)
    os.replace(f2, f)                                       # other bytes at the same path
    c = LH.load_model(str(f), fast=False)
    assert len(calls) == 2 and c.key != a.key


def test_the_hash_is_remembered_by_path_size_and_mtime(tmp_path, monkeypatch):
    f, _ = _tiny_gguf(tmp_path)
    h = LS.file_hash(f)
    opened = []
    real_open = open

    def spy(p, *a, **k):
        opened.append(str(p))
        return real_open(p, *a, **k)

    with monkeypatch.context() as mp:       # (undo() would also drop the test's own cache dir)
        mp.setattr("builtins.open", spy)
        assert LS.file_hash(f) == h and str(f.resolve()) not in opened      # a second call reads nothing
    data = bytearray(f.read_bytes())
    data[-1] ^= 1                                           # same size, new content (and mtime)
    st = f.stat()
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert LS.file_hash(f) != h


def test_two_first_uses_at_once_convert_once(tmp_path, monkeypatch):
    f, _ = _tiny_gguf(tmp_path)
    calls = _count_conversions(monkeypatch)
    got, errors = [], []

    def use():
        try:
            got.append(LG.ensure_gguf(f)[0])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(calls) == 1 and len(set(got)) == 1
    assert not [p for p in got[0].parent.iterdir() if p.name.endswith(".part")]     # no leftovers


def test_without_working_locks_racing_conversions_still_leave_one_whole_copy(tmp_path, monkeypatch):
    import contextlib

    from rakv.util import filelock

    f, m = _tiny_gguf(tmp_path)
    monkeypatch.setattr(filelock, "file_lock", lambda *a, **k: contextlib.nullcontext())
    barrier = threading.Barrier(2)
    real = LG._load_gguf

    def slow(path):
        out = real(path)
        barrier.wait(timeout=60)            # both have converted before either installs
        return out

    monkeypatch.setattr(LG, "_load_gguf", slow)
    errors = []

    def use():
        try:
            LG.ensure_gguf(f)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    folder = LG.ensure_gguf(f)[0]
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}")] in ([], [f".{folder.name}.lock"])
    monkeypatch.setattr(LG, "_load_gguf", real)
    _same_weights(LH.load_model(str(f), fast=False).model, m)


def test_a_conversion_that_cannot_be_loaded_even_when_made_again_names_the_folder_to_delete(tmp_path, monkeypatch):
    """A damaged conversion is made again once (tests/unit/test_gguf_load.py); when even the new one
    cannot be loaded, the error names the folder."""
    f, _ = _tiny_gguf(tmp_path)
    folder, _ = LG.ensure_gguf(f)
    (folder / "config.json").write_text("{broken")
    with monkeypatch.context() as mp:       # (undo() would also drop the test's own cache dir)
        calls = _count_conversions(mp)
        real = LG.convert_gguf

        def still_broken(*a, **k):
            real(*a, **k)
            (a[1] / "config.json").write_text("{broken")

        mp.setattr(LG, "convert_gguf", still_broken)
        with pytest.raises(LL.ModelError) as e:
            LH.load_model(str(f), fast=False)
        assert str(folder) in str(e.value) and "delete" in str(e.value) and len(calls) == 1
    shutil.rmtree(folder)
    LH.load_model(str(f), fast=False)          # converted afresh


@pytest.mark.fast
def test_a_gguf_the_loader_cannot_read_is_one_clear_error(tmp_path):
    f = tmp_path / "junk.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LL.ModelError, match="cannot load GGUF"):
        LH.load_model(str(f), fast=False)
    models = LS.cache_dir() / "models"
    assert not list(models.glob("gguf-*")) and not list(models.glob(".*.part"))     # nothing half-made left


@pytest.mark.parametrize("add_bos", [True, False])
def test_the_converted_tokenizer_encodes_a_raw_prompt_as_the_gguf_does(tmp_path, add_bos):
    """transformers drops add_bos_token when it saves a tokenizer; the loader sets the flag again
    from what the tokenizer does, so a raw prompt keeps its BOS."""
    from transformers import AutoTokenizer

    from rakv.prompts import raw_ids

    f = tmp_path / "bos.gguf"
    write_llama_gguf(f, make_model("llama"), add_bos=add_bos)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    lm = LH.load_model(str(f), fast=False)
    text = "The quick brown fox"
    assert raw_ids(lm.tokenizer, text) == raw_ids(ref, text) == ref(text)["input_ids"]
    assert (raw_ids(lm.tokenizer, text)[0] == 0) == add_bos
