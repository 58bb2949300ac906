"""A second load of a ``.gguf`` uses what the first one made: no conversion, no tokenizer build
(the built tokenizer is kept pickled in the converted folder and gives the same ids, decoded text
and chat prompts as the one transformers builds), no reading of the file; a changed file is
converted again, a damaged conversion, tokenizer pickle or hash index is made again. A policy
that never drafts does not make the int8 draft. Tiny GGUFs written with the ``gguf`` package, no
network."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import rakv.drafts.int8 as DI
import rakv.load.gguf as LG
import rakv.load.hub as LH
import rakv.load.numerics as LN
import rakv.load.slim as LS
import rakv.load.tokenizer as LT

from tests.unit.test_gguf import PROMPT, _count_conversions, _same_weights, _tiny_gguf, settle, write_llama_gguf
from tests.tiny import CHAT_TEMPLATE, make_model, oracle

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "naïve café — Größe 日本語 🙂 ½ Привет",
         "  two  spaces\tand a tab\n\nnew lines", "<eos>special<pad> tokens <eos>", "x = {'a': [1, 2.5]}", ""]
CHAT = [{"role": "user", "content": "Hi 🙂, what is 日本語?"}, {"role": "assistant", "content": "Japanese — a language."},
        {"role": "user", "content": "naïve?"}]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))


def _count_tokenizer_builds(monkeypatch) -> list:
    from transformers import AutoTokenizer

    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def counted(cls, *a, **k):
        calls.append(a[0] if a else k)
        return real(cls, *a, **k)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    return calls


def _chat_gguf(d: Path, seed: int = 0) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"chat-{seed}.gguf"
    write_llama_gguf(f, make_model("llama", seed=seed), chat_template=CHAT_TEMPLATE)
    return f


def _assert_same_tokenizer(tok, ref) -> None:
    """Same ids (with and without special tokens), decoded text, vocabulary, special ids and chat prompts."""
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, text
        assert tok(text, add_special_tokens=False)["input_ids"] == ref(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.get_vocab() == ref.get_vocab()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert tok.all_special_ids == ref.all_special_ids and type(tok) is type(ref)
    if ref.chat_template:
        for gen in (True, False):
            a = tok.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
            assert a == ref.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
            assert tok(a, add_special_tokens=False)["input_ids"] == ref(a, add_special_tokens=False)["input_ids"]


def test_the_second_load_converts_nothing_builds_no_tokenizer_and_reads_no_file(tmp_path, monkeypatch):
    f = _chat_gguf(tmp_path / "src")
    conversions = _count_conversions(monkeypatch)
    builds = _count_tokenizer_builds(monkeypatch)
    first = LH.load_model(str(f), fast=False)
    assert len(conversions) == 1 and len(builds) >= 1
    folder = LG.ensure_gguf(f)[0]
    assert (folder / LT.TOKENIZER_CACHE).is_file()           # the built tokenizer, kept
    builds.clear()
    opened = []
    real_open = open

    def spy(p, *a, **k):
        opened.append(str(p))
        return real_open(p, *a, **k)

    with monkeypatch.context() as mp:       # (undo() would also drop the test's own cache dir)
        mp.setattr("builtins.open", spy)
        second = LH.load_model(str(f), fast=False)
    assert len(conversions) == 1 and builds == []          # nothing converted, no tokenizer built
    assert str(f.resolve()) not in opened                  # the GGUF is not even read (its hash is remembered)
    assert first.key == second.key
    _same_weights(first.model, second.model)
    assert oracle(first.model, PROMPT, 12) == oracle(second.model, PROMPT, 12)
    _assert_same_tokenizer(second.tokenizer, first.tokenizer)


def test_the_kept_tokenizer_is_the_one_transformers_builds_from_the_folder_and_the_gguf(tmp_path):
    from transformers import AutoTokenizer

    from rakv.prompts import raw_ids

    f = _chat_gguf(tmp_path / "src")
    LH.load_model(str(f), fast=False)                        # converts and keeps the tokenizer
    folder = LG.ensure_gguf(f)[0]
    kept = LH.load_model(str(f), fast=False).tokenizer       # from the pickle
    built = AutoTokenizer.from_pretrained(str(folder))
    LT._note_bos(built)
    from_gguf = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    _assert_same_tokenizer(kept, built)
    for text in TEXTS:
        assert raw_ids(kept, text) == raw_ids(from_gguf, text) == from_gguf(text)["input_ids"]
        assert kept.decode(from_gguf(text)["input_ids"]) == from_gguf.decode(from_gguf(text)["input_ids"])
    assert kept.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        from_gguf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def _gemma_like_folder(d: Path) -> Path:
    """A folder holding a tokenizer whose class builds its BPE in its own constructor (as Gemma's
    does), as transformers saves it."""
    from transformers import GemmaTokenizer

    words = ["▁the", "▁quick", "▁brown", "▁fox", "▁ca", "fé", "▁日本", "語", "▁Hello"]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    merges = []
    for w in words:
        for ch in w:
            vocab.setdefault(ch, len(vocab))
        cur = w[0]
        for ch in w[1:]:
            merges.append((cur, ch))
            cur += ch
            vocab.setdefault(cur, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.chat_template = CHAT_TEMPLATE.replace("<pad>", "<bos>")
    d.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(d)
    return d


def test_a_tokenizer_with_its_own_constructor_is_kept_and_restored_the_same(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    d = _gemma_like_folder(tmp_path / "gemma-like")
    with monkeypatch.context() as mp:
        builds = _count_tokenizer_builds(mp)
        first = LT.load_tokenizer(d)
        assert len(builds) == 1 and (d / LT.TOKENIZER_CACHE).is_file()
        second = LT.load_tokenizer(d)
        assert len(builds) == 1
    ref = AutoTokenizer.from_pretrained(str(d))
    assert type(second).__name__ == "GemmaTokenizer" and second.padding_side == ref.padding_side
    _assert_same_tokenizer(first, ref)
    _assert_same_tokenizer(second, ref)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "stale", "probes"])
def test_a_damaged_or_stale_tokenizer_pickle_is_built_again(tmp_path, monkeypatch, damage):
    from transformers import AutoTokenizer

    d = _gemma_like_folder(tmp_path / "t")
    LT.load_tokenizer(d)
    kept = d / LT.TOKENIZER_CACHE
    data = kept.read_bytes()
    if damage == "garbage":
        kept.write_bytes(b"not a pickle at all" * 10)
    elif damage == "truncated":
        kept.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "empty":
        kept.write_bytes(b"")
    elif damage == "stale":                                 # the tokenizer's files changed since
        st = (d / "tokenizer.json").stat()
        os.utime(d / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    else:                                                   # restores, but encodes otherwise than when kept
        with open(kept, "rb") as fh:
            head = pickle.load(fh)
            tok = pickle.load(fh)
        head["probes"]["Hello"] = [[999], [999]]
        with open(kept, "wb") as fh:
            pickle.dump(head, fh)
            pickle.dump(tok, fh)
    with monkeypatch.context() as mp:
        builds = _count_tokenizer_builds(mp)
        tok = LT.load_tokenizer(d)
        assert len(builds) == 1                             # built again ...
        LT.load_tokenizer(d)
        assert len(builds) == 1                             # ... and kept again
    _assert_same_tokenizer(tok, AutoTokenizer.from_pretrained(str(d)))


def test_a_cache_dir_that_cannot_be_written_still_loads(tmp_path, monkeypatch):
    d = _gemma_like_folder(tmp_path / "t")
    monkeypatch.setattr(LT.tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(PermissionError("read-only")))
    tok = LT.load_tokenizer(d)
    assert tok("Hello")["input_ids"] and not (d / LT.TOKENIZER_CACHE).exists()


def test_a_damaged_conversion_is_converted_again(tmp_path, monkeypatch, capsys):
    f, m = _tiny_gguf(tmp_path / "src")
    calls = _count_conversions(monkeypatch)
    folder, _ = LG.ensure_gguf(f)
    (folder / "config.json").write_text("{broken")
    lm = LH.load_model(str(f), fast=False)
    assert len(calls) == 2 and "converting it again" in capsys.readouterr().err
    _same_weights(lm.model, m)
    assert json_ok(folder / "config.json")
    LH.load_model(str(f), fast=False)
    assert len(calls) == 2                                  # and kept


def json_ok(p: Path) -> bool:
    import json

    json.loads(p.read_text())
    return True


def test_a_missing_weights_file_is_converted_again(tmp_path, monkeypatch):
    f, m = _tiny_gguf(tmp_path / "src")
    calls = _count_conversions(monkeypatch)
    folder, _ = LG.ensure_gguf(f)
    for w in folder.glob("model*.safetensors"):
        w.unlink()
    _same_weights(LH.load_model(str(f), fast=False).model, m)
    assert len(calls) == 2


def test_a_changed_file_is_converted_again_a_touched_one_is_hashed_again_only(tmp_path, monkeypatch):
    f, m = _tiny_gguf(tmp_path / "src")
    calls = _count_conversions(monkeypatch)
    a = LH.load_model(str(f), fast=False)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000))      # same bytes, new mtime
    hashed = []
    real = LS.hashlib.blake2b

    def counted(*x, **k):
        if k.get("digest_size") == 16:
            hashed.append(1)
        return real(*x, **k)

    monkeypatch.setattr(LS.hashlib, "blake2b", counted)
    b = LH.load_model(str(f), fast=False)
    assert hashed and len(calls) == 1 and a.key == b.key      # read again, same content: the same copy
    hashed.clear()
    LH.load_model(str(f), fast=False)
    assert not hashed                                         # remembered again
    big = make_model("llama", seed=5, hidden=96)               # another size at the same path
    write_llama_gguf(f, big, settled=False)                   # written just now: its stamp is racy
    written = f.stat()
    c = LH.load_model(str(f), fast=False)
    assert len(calls) == 2 and c.key != a.key
    _same_weights(c.model, big)
    data = bytearray(f.read_bytes())                          # same size, other bytes, written at once:
    data[-1] ^= 1                                             # maybe the same stamp (a coarse clock's tick)
    f.write_bytes(bytes(data))
    os.utime(f, ns=(written.st_atime_ns, written.st_mtime_ns))
    d = LH.load_model(str(f), fast=False)
    assert len(calls) == 3 and d.key not in (a.key, c.key)


def test_a_file_written_just_now_is_hashed_on_every_load(tmp_path):
    """Rewritten within one tick of the filesystem's clock, a file of the same size keeps its stamp:
    a hash taken that close to its writing is not remembered, so the new bytes are found."""
    f, _ = _tiny_gguf(tmp_path / "src")
    t = time.time_ns()
    os.utime(f, ns=(t, t))
    h = LS.file_hash(f)
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    os.utime(f, ns=(t, t))                                    # the very same stamp, as a coarse clock gives
    assert LS.file_hash(f) != h


def test_a_damaged_hash_index_is_rebuilt(tmp_path):
    f, _ = _tiny_gguf(tmp_path / "src")
    h = LS.file_hash(f)
    index = LS._hash_index()
    index.write_text("{not json")
    assert LS.file_hash(f) == h
    import json

    assert json.loads(index.read_text())[str(f.resolve())]["blake2b"] == h
    gone = tmp_path / "gone.gguf"                              # entries of files that no longer exist are dropped
    gone.write_bytes(f.read_bytes())
    settle(gone)
    LS.file_hash(gone)
    assert str(gone.resolve()) in json.loads(index.read_text())
    gone.unlink()
    g = tmp_path / "other.gguf"
    g.write_bytes(f.read_bytes() + b"\0")
    settle(g)
    LS.file_hash(g)
    assert str(gone.resolve()) not in json.loads(index.read_text())


# ----------------------------------------------------------------------------- the int8 draft
def test_a_policy_that_never_drafts_does_not_make_the_int8_draft(monkeypatch):
    """ar and kv never draft; adaptive drafts only where its measured costs say it pays: the int8
    copy is made when first used (a fixed k > 0 makes it at once; so does calibrating)."""
    from rakv import session
    from rakv.config import RakvConfig

    from tests.tiny import tiny_tokenizer

    target = LN.wrap(make_model("llama"), tiny_tokenizer(), name="tiny", fast=False)
    monkeypatch.setattr(LH, "load_model", lambda *a, **k: target)
    made = []
    real = DI._quantized
    monkeypatch.setattr(DI, "_quantized", lambda t: made.append(1) or real(t))
    for policy, eager in (("ar", False), ("kv", False), ("spec:2", True), ("joint:4", True), ("adaptive", False),
                          ("adaptive:gate", False)):
        made.clear()
        draft = session.load(RakvConfig(target="x", draft="int8", policy=policy, fast=False)).draft
        assert len(made) == (1 if eager else 0), policy
        assert draft.key == target.key.rsplit(":", 1)[0] + ":int8-dynamic" and draft.name == "tiny-int8"
        assert draft.lm.kv_bytes_per_token() == target.kv_bytes_per_token()
        assert len(made) == (1 if eager else 0)
    made.clear()
    session.load(RakvConfig(target="x", draft="int8", policy="ar", fast=False), recalibrate=True)
    assert made == [1]                                          # calibrating measures the draft


def test_the_lazy_int8_draft_is_the_eager_one():
    from copy import deepcopy

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from tests.tiny import tiny_tokenizer

    for fast in (False, True):
        target = LN.wrap(make_model("llama"), tiny_tokenizer(), name="tiny", fast=fast)
        eager = DI.int8_copy(target)
        lazy = DI.int8_copy(target, lazy=True)
        assert lazy.lean == eager.lean and lazy.key == eager.key
        sa, sb = eager.model.state_dict(), lazy.model.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k].int_repr() if sa[k].is_quantized else sa[k],
                                   sb[k].int_repr() if sb[k].is_quantized else sb[k]), k
        x = torch.tensor([PROMPT])
        with torch.no_grad():
            assert torch.equal(eager.model(x).logits, lazy.model(x).logits)
        if not fast:                         # quantizing our copy in place = quantize_dynamic's own copy
            ref = quantize_dynamic(deepcopy(target.model).float(), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                   dtype=torch.qint8)
            with torch.no_grad():
                assert torch.equal(ref(x).logits, eager.model(x).logits)
        assert lazy.kv_bytes_per_token() == eager.kv_bytes_per_token()


def test_the_first_use_shows_progress_and_the_second_shows_none(tmp_path, monkeypatch, capsys):
    f, _ = _tiny_gguf(tmp_path / "src")
    monkeypatch.setattr(LS, "HASH_CHUNK", 4096)              # the tiny file counts as a big one
    LH.load_model(str(f), fast=False)
    err = capsys.readouterr().err
    assert "hashing" in err and "100.0%" in err             # reading the file
    assert "converting" in err and "saving the converted model" in err and "converted in" in err
    LH.load_model(str(f), fast=False)
    err = capsys.readouterr().err
    assert "hashing" not in err and "convert" not in err and "loaded" in err


def test_two_conversions_at_once_leave_the_gguf_module_as_it_was():
    """Two threads converting at once (two first uses of two files): each patches the gguf module
    while it reads; interleaved, the later one restored the earlier one's patch and a reader cache
    outlived its conversion (a file rewritten at the same path was then read as it had been)."""
    import threading

    import gguf as G

    original = G.GGUFReader
    inside, release, first_done = threading.Event(), threading.Event(), threading.Event()

    def first():
        with LG._gguf_read_once():
            inside.set()
            release.wait(10)
        first_done.set()

    def second():                       # enters while the first is inside, leaves after it
        inside.wait(10)
        with LG._gguf_read_once():
            first_done.wait(10)

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start()
    b.start()
    inside.wait(10)
    time.sleep(0.2)                     # the second thread is now at the door
    release.set()
    a.join(10)
    b.join(10)
    assert G.GGUFReader is original


def test_the_adaptive_policy_makes_the_int8_draft_only_when_it_drafts_and_times_rounds_without_it(monkeypatch):
    """A profile where no k pays: the adaptive policy never makes the int8 draft. One where drafting
    pays: the first drafting round makes it, and the round's draft and round times leave the making
    out (a cost model that learned a 0.4 s draft step would never draft again)."""
    from rakv.config import RakvConfig
    from rakv.drafts.model import ModelDraft
    from rakv.engine import Engine
    from rakv.records import Round

    from tests.tiny import synthetic_profile, tiny_tokenizer

    target = LN.wrap(make_model("llama"), tiny_tokenizer(), name="tiny", fast=False)
    made = []
    real = DI._quantized
    monkeypatch.setattr(DI, "_quantized", lambda t: made.append(1) or time.sleep(0.4) or real(t))
    prompt = [(5 * i + 3) % 300 for i in range(20)]
    for d, drafts in ((5.0, False), (0.01, True)):               # d/t: a draft step 5x a target step, or free
        made.clear()
        rounds = []
        lazy = ModelDraft(DI.int8_copy(target, lazy=True))
        eng = Engine(target, lazy, RakvConfig(policy="adaptive", k_set=(0, 2, 4)),
                     profile=synthetic_profile(d=d, alpha0=0.9), callback=rounds.append)
        for _ in range(2):
            eng.generate(prompt, 12)
        spec = [r for r in rounds if isinstance(r, Round) and r.kind == "spec" and r.drafted
                and r.draft_source != "lookup"]                      # the model draft's rounds
        assert bool(made) == drafts == bool(spec), d
        if drafts:
            assert made == [1] and max(r.draft_ms for r in spec) < 300 and max(r.round_ms for r in spec) < 300
