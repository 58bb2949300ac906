"""The backend (``rakv.backends``): chosen once at load behind one interface (prefill, step, verify,
tree, rollback, fingerprint); the environment's switches read then, not per forward; every policy
still equals ``ar`` through each backend; the cost fingerprint and ``--json`` name it."""

from __future__ import annotations

import json

import pytest
import torch

from rakv import decoding as dec
from rakv.backends import (BACKENDS, LeanFp32Backend, LeanQ8Backend, TorchBackend, backend_of, lean_of,
                           read_switches, set_backend)
from rakv.config import RakvConfig
from rakv.decide.profile import fingerprint_id, pair_fingerprint
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.kernels import blockq, lean
from rakv.drafts.int8 import int8_copy
from rakv.load.loaded import model_info
from rakv.load.numerics import set_fast, set_numerics
from tests.tiny import assert_exact, make_model, make_pair

from tests.unit.test_fastpath import _NO_ONEDNN, needs_onednn

kernel = pytest.mark.skipif(blockq.library() is None, reason=f"no block kernel: {blockq.reason()}")
N = 16


def prompts():
    base = list(range(5, 37))
    return [base, base[:20] + [7, 8, 9], [3, 4, 5] * 5]


def _pair(arch: str, backend: str, agreement: str = "mostly"):
    """(target, draft) on ``backend``: torch (HF's forward over the packed linears: RAKV_LEAN=0 at
    load), torch-plain (no fast path), lean-fp32, lean-q8."""
    forward = {"torch": "hf", "torch-plain": "plain"}.get(backend, "lean")
    t, d = make_pair(arch, agreement, forward=forward)
    if backend == "lean-q8":
        set_numerics(t, "q8")
        set_numerics(d, "q8")
    return t, d


# ----------------------------------------------------------------------------- chosen at load
@pytest.mark.fast
@needs_onednn
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_backend_is_chosen_at_load(arch):
    t, d = _pair(arch, "lean-fp32")
    assert isinstance(t.backend, LeanFp32Backend) and t.backend.name == "lean-fp32"
    assert backend_of(t.model) is t.backend and d.backend.name == "lean-fp32"
    assert t.backend.lean is lean_of(t.model) and t.backend.tree_ok and dec.tree_forward_ok(t.model)
    for backend in ("torch", "torch-plain"):                  # RAKV_LEAN=0 at load, or no fast path
        h, _ = _pair(arch, backend)
        assert isinstance(h.backend, TorchBackend) and h.backend.name == "torch" and backend_of(h.model) is h.backend
        assert not dec.tree_forward_ok(h.model)
        assert dec.verify_tree(h.model, [1, 2, 3], [-1, 0, 0], dec.DynamicCache()) is None
    assert model_info(t)["backend"] == "lean-fp32" and model_info(h)["backend"] == "torch"
    bare = make_model(arch)                                   # no loader chose: the torch path
    assert isinstance(backend_of(bare), TorchBackend)


@kernel
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_numerics_switch_chooses_again(arch):
    t, _ = make_pair(arch, "mostly")
    assert t.backend.name == "lean-fp32"
    set_numerics(t, "q8")
    assert isinstance(t.backend, LeanQ8Backend) and backend_of(t.model) is t.backend
    assert t.backend.fingerprint()["numerics"] == "q8"
    set_numerics(t, "fp32")
    assert t.backend.name == "lean-fp32"


def test_a_bare_module_given_a_lean_forward_by_hand_runs_it():
    m = make_model("llama")
    assert isinstance(backend_of(m), TorchBackend)
    assert lean.attach(m) == ""                              # drops the choice: made again at the next forward
    be = backend_of(m)
    assert isinstance(be, LeanFp32Backend) and be.lean is lean_of(m)


@kernel
def test_switches_changed_after_load_change_nothing_until_the_next_load(monkeypatch):
    """RAKV_C_LAYERS, RAKV_LEAN and RAKV_TILES are read when the backend is chosen: set after
    load they change nothing (the same kernel calls, the same backend, the same tiles form); a
    load / switch (``set_fast``) reads them again."""
    for k in ("RAKV_C_LAYERS", "RAKV_LEAN", "RAKV_TILES", "RAKV_BLOCKQ"):
        monkeypatch.delenv(k, raising=False)
    t, _ = make_pair("llama", "mostly")
    set_numerics(t, "q8")
    assert t.backend.switches == read_switches() and t.backend.lean.c_layers_on()
    calls = []
    real = blockq.decode_layers
    monkeypatch.setattr(blockq, "decode_layers", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    def step():
        c = dec.DynamicCache()
        dec.prefill(t.model, list(range(5, 25)), c)
        calls.clear()
        return dec.decode_one(t.model, 7, c)

    before = step()
    assert calls == [1]
    fp = pair_fingerprint(t, None)
    head = t.model.lm_head.block
    monkeypatch.setenv("RAKV_C_LAYERS", "0")
    monkeypatch.setenv("RAKV_LEAN", "0")
    monkeypatch.setenv("RAKV_TILES", "0")
    assert torch.equal(step(), before) and calls == [1]              # still one C call for the step's layers
    assert t.backend.name == "lean-q8" and not head.lanes and pair_fingerprint(t, None) == fp
    monkeypatch.delenv("RAKV_LEAN")
    set_fast(t, t.fast)                                              # a load / switch reads them again
    assert t.backend.name == "lean-q8" and not t.backend.switches.c_layers and not t.backend.lean.c_layers_on()
    assert t.model.lm_head.block.lanes                               # the lane form, made at this load
    after = step()
    assert calls == []                                               # the Python layers now
    assert torch.equal(after.argmax(), before.argmax())
    fp2 = pair_fingerprint(t, None)
    assert fp2 != fp and fingerprint_id(fp2) != fingerprint_id(fp)
    assert fp2["backend"]["c_layers"] is False and fp2["backend"]["tiles"] == "lanes"


@needs_onednn
def test_a_lazy_int8_draft_runs_by_its_targets_switches(monkeypatch):
    monkeypatch.delenv("RAKV_C_LAYERS", raising=False)
    t, _ = make_pair("llama", "mostly")
    d = int8_copy(t, lazy=True)
    monkeypatch.setenv("RAKV_C_LAYERS", "0")                         # after the target's load
    d.model  # noqa: B018 - made now
    assert d.backend is not None and d.backend.switches == t.backend.switches and d.backend.switches.c_layers


# ----------------------------------------------------------------------------- fingerprints
@kernel
@needs_onednn
def test_fingerprints_differ_between_backends():
    fps = {}
    for backend in ("torch", "torch-plain", "lean-fp32", "lean-q8"):
        t, _ = _pair("llama", backend)
        fp = t.backend.fingerprint()
        assert {"kind", "numerics", "device", "threads", "isa", "fast"} <= set(fp)
        assert fp["threads"] == torch.get_num_threads() and fp["device"] == "cpu"
        if backend.startswith("lean"):
            assert fp["kernel"] == blockq.build_id() and "c_layers" in fp
        fps[backend] = (fp, pair_fingerprint(t, None))
    assert fps["lean-q8"][0]["tiles"] in ("tiled", "lanes")
    kinds = [fp["kind"] for fp, _ in fps.values()]
    assert kinds == ["torch", "torch", "lean-fp32", "lean-q8"]
    ids = {fingerprint_id(p["backend"]) for _, p in fps.values()}
    assert len(ids) == 4                                     # each backend its own profile


# ----------------------------------------------------------------------------- the interface
@pytest.mark.fast
def test_decoding_delegates_to_the_models_backend():
    """``rakv.decoding``'s primitives (what the engine calls, with the model) call its backend."""
    m = make_model("llama")
    seen = []

    class Spy(TorchBackend):
        name = "spy"

        def forward(self, tokens, cache, keep=0, tree=None):
            seen.append(("forward", len(list(tokens)), keep))
            return super().forward(tokens, cache, keep, tree)

        def tree(self, tokens, parents, cache):
            seen.append(("tree", len(tokens)))
            return None

    set_backend(m, Spy(m))
    c = dec.DynamicCache()
    assert dec.prefill(m, [5, 6, 7, 8], c).dim() == 1
    assert dec.decode_one(m, 9, c).dim() == 1
    assert dec.verify(m, [1, 2, 3], c).shape[0] == 3
    assert dec.verify_tree(m, [1, 2], [-1, 0], c) is None and not dec.tree_forward_ok(m)
    assert seen == [("forward", 4, 1), ("forward", 1, 1), ("forward", 3, 0), ("tree", 2)]
    dec.rollback(c, 3)
    assert dec.cache_len(c) == 5


def test_decoding_takes_a_backend_or_a_module():
    """The primitives take a backend, or a module whose backend ``backend_of`` finds: the same logits."""
    m = make_model("llama")
    be = TorchBackend(m)
    assert backend_of(be) is be
    c1, c2 = dec.DynamicCache(), dec.DynamicCache()
    assert torch.equal(dec.prefill(be, [5, 6, 7, 8], c1), dec.prefill(m, [5, 6, 7, 8], c2))
    assert torch.equal(dec.decode_one(be, 9, c1), dec.decode_one(m, 9, c2))
    assert torch.equal(dec.verify(be, [1, 2, 3], c1), dec.verify(m, [1, 2, 3], c2))


@kernel
@needs_onednn
def test_nothing_is_pinned_on_the_caches_or_layers():
    """The lean backend's state (its KV buffers and views) lives beside the cache, not on it."""
    t, _ = make_pair("llama", "mostly")
    c = dec.DynamicCache()
    dec.prefill(t.model, list(range(5, 30)), c)
    for tok in (7, 8, 9):
        dec.decode_one(t.model, tok, c)
    dec.verify(t.model, [1, 2, 3, 4], c)
    dec.rollback(c, 2)
    assert lean.views_of(c) is not None or all(L in lean.kv._BUFS for L in c.layers)   # its buffers, beside it
    for obj in (c, *c.layers):
        assert not [k for k in getattr(obj, "__dict__", {}) if k.startswith("_rakv")]
    assert lean_of(t.model) is t.backend.lean


# ----------------------------------------------------------------------------- exact through each backend
@pytest.mark.parametrize("backend", ["torch", "torch-plain", "lean-fp32", "lean-q8"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_policy_equals_ar_through_each_backend(arch, backend):
    if backend != "torch-plain" and _NO_ONEDNN is not None:
        pytest.skip(f"{_NO_ONEDNN} (the packed fast path needs it)")
    if backend == "lean-q8" and blockq.library() is None:
        pytest.skip(f"no block kernel: {blockq.reason()}")
    t, d = _pair(arch, backend)
    assert t.backend.name == ("torch" if backend.startswith("torch") else backend)
    ar = Engine(t, None, RakvConfig(policy="ar"))
    want = {tuple(p): ar.generate(p, N).output_ids for p in prompts()}
    if backend != "lean-q8":                                          # fp32 arithmetic: transformers' ids
        for p in prompts():
            assert_exact(ar.generate(p, N), t, p, N, backend)
    runs = [(ModelDraft(d), "spec:3"), (ModelDraft(d), "joint:2"), (NgramDraft(), "tree:6"), (NgramDraft(), "spec:4")]
    for src, policy in runs:
        eng = Engine(t, src, RakvConfig(policy=policy))
        for p in prompts() + prompts()[:1]:                           # (the last: an exact repeat)
            assert eng.generate(p, N).output_ids == want[tuple(p)], (backend, policy, p[:4])


# ----------------------------------------------------------------------------- named in --json
def test_generate_json_names_the_backend(tmp_path, capsys):
    from rakv.cli import main
    from tests.tiny import save_tiny

    save_tiny(tmp_path / "target", "llama")
    rec = tmp_path / "run.jsonl"
    code = main(["generate", "--target", str(tmp_path / "target"), "--draft", "ngram", "--prompt", "alpha beta gamma",
                 "--max-new-tokens", "4", "--policy", "spec:2", "--json", "--record", str(rec)])
    out, err = capsys.readouterr()
    assert code == 0, err
    o = json.loads(out.splitlines()[0])
    assert o["backend"] in BACKENDS
    header = json.loads(rec.read_text().splitlines()[0])
    assert header["target"]["backend"] == o["backend"]
