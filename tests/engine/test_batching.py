"""Continuous batching (``rakv.engine.batch``, ``rakv serve --parallel``): requests decode together, one
forward a step carrying all their rows, and every request's tokens equal its solo run, whatever
arrives beside it, in any order: greedy and seeded, every policy, partial and exact prefix hits,
EOS mid-round, long prompts fed in chunks, a request stopped mid-way; q8 and fp32 numerics, Llama
and GPT-2 tiny models. The server's side: 429 past the queue, 401 without the API key, a client
that goes away, shutdown with open streams. No test depends on timing."""

from __future__ import annotations

import json
import random
import threading
import urllib.request

import pytest
import torch
from transformers import DynamicCache

from rakv import decoding as dec
from rakv.backends import backend_of
from rakv.engine.batch import LanePool
from rakv.config import RakvConfig
from rakv.drafts.model import ModelDraft
from rakv.drafts.ngram import NgramDraft
from rakv.engine import Engine
from rakv.kernels import blockq
from rakv.kernels.segments import forward_segments, segments_ok
from rakv.load.numerics import set_numerics
from rakv.records import Round, Step, from_dict, request_rows, to_dict
from rakv.config import Sampling
from tests.tiny import EOS_PROMPTS, make_pair, synthetic_profile

kernel = pytest.mark.skipif(blockq.library() is None, reason=f"no block kernel: {blockq.reason()}")
N = 16


def _pair(arch: str, numerics: str, eos=None):
    t, d = make_pair(arch, "mostly", eos=eos)
    return set_numerics(t, numerics), set_numerics(d, numerics)


def _prompts(seed: int = 1) -> list[list[int]]:
    """Short and long prompts (past PREFILL_CHUNK: fed in chunks), shared prefixes (partial hits) and
    a repeat (an exact hit)."""
    rng = random.Random(seed)
    base = list(range(5, 140))
    out = [[rng.randrange(5, 200) for _ in range(rng.randrange(3, 150))] for _ in range(6)]
    return out + [base[:100], base[:100], base[:60] + [7, 8], base[:130]]


def _solo(target, prompt, rid: int, s: Sampling, n: int = N) -> list[int]:
    e = Engine(target, None, RakvConfig(policy="ar", sampling=s))
    e._next_id = rid                      # (a seeded request's seed is the call's + its id)
    return e.generate(prompt, n).output_ids


def _serve_all(engine, prompts, lanes: int, seed: int, n: int = N, steps=None, pools=None):
    """Every prompt through a LanePool of ``lanes``, from ``lanes`` client threads in a random order;
    {request_id: (prompt, RequestEnd)} (the pool appended to ``pools``, or handed to it first where
    it is a function)."""
    pool = LanePool(engine, lanes, on_step=(steps.append if steps is not None else None))
    if callable(pools):
        pools(pool)
    elif pools is not None:
        pools.append(pool)
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    done, errors = {}, []

    def client(mine):
        try:
            for i in mine:
                with pool.lane() as lane:
                    end = lane.generate(prompts[i], n)
                done[end.request_id] = (prompts[i], end)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(order[j::lanes],)) for j in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(done) == len(prompts)
    return done


@kernel
def test_rows_of_several_requests_in_one_pass_equal_each_forward_alone():
    """The kernel's segments: decode steps and verify rows of different requests in one call give
    each request's logits and KV bit for bit as its own forward (q8 numerics)."""
    t, _ = _pair("llama", "q8")
    lean = backend_of(t.model).lean
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 200) for _ in range(rng.randrange(3, 40))] for _ in range(5)]
    ref = []
    for p in prompts:
        c = DynamicCache()
        rows = [dec.prefill(t.model, p, c)]
        seq = [int(rows[0].argmax())]
        for _ in range(6):
            rows.append(dec.decode_one(t.model, seq[-1], c))
            seq.append(int(rows[-1].argmax()))
        ref.append((seq, rows))
    caches = []
    for p in prompts:
        c = DynamicCache()
        dec.prefill(t.model, p, c)
        caches.append(c)
    assert segments_ok(lean, caches)
    segs = [(ref[i][0][: 1 + i % 4], caches[i], 0) for i in range(5)]        # 1 to 4 rows each
    for i, out in enumerate(forward_segments(lean, segs)):
        for j in range(out.shape[0]):
            assert torch.equal(out[j], ref[i][1][j + 1]), (i, j)
    segs = [([ref[i][0][i % 4 + 1]], caches[i], 1) for i in range(5)]         # then one step each, together
    for i, out in enumerate(forward_segments(lean, segs)):
        assert torch.equal(out[-1], ref[i][1][i % 4 + 2]), i


@pytest.mark.parametrize("arch,numerics", [("llama", "q8"), ("llama", "fp32"), ("gpt2", "q8")])
@pytest.mark.parametrize("policy,draft", [("ar", None), ("kv", None), ("spec:3", "model"), ("joint:2", "ngram"),
                                          ("adaptive", "model")])
@pytest.mark.parametrize("greedy", [True, False])
def test_every_request_equals_its_solo_run_whatever_shares_its_steps(arch, numerics, policy, draft, greedy):
    if numerics == "q8" and blockq.library() is None:
        pytest.skip(f"no block kernel: {blockq.reason()}")
    t, d = _pair(arch, numerics)
    s = Sampling() if greedy else Sampling(temperature=0.8, top_p=0.95, seed=11)
    src = ModelDraft(d) if draft == "model" else NgramDraft() if draft == "ngram" else None
    eng = Engine(t, src, RakvConfig(policy=policy, sampling=s), profile=synthetic_profile())
    steps = []
    prompts = _prompts(seed=len(policy))
    done = _serve_all(eng, prompts, 4, seed=len(policy) + greedy, steps=steps)
    for rid, (p, end) in done.items():
        assert end.output_ids == _solo(t, p, rid, s), (rid, end.stopped)
    shared = [st for st in steps if len(st.rows) > 1]
    assert shared                                              # requests did meet in steps
    if numerics == "q8" and arch == "llama":
        assert any(st.shared for st in shared)                 # ... and shared one pass over the weights
    else:
        assert not any(st.shared for st in shared)             # each forward alone inside the step


@kernel
def test_eos_mid_round_and_a_stopped_request_among_others():
    t, d = _pair("llama", "q8", eos="emitted")
    eng = Engine(t, ModelDraft(d), RakvConfig(policy="spec:4"), profile=synthetic_profile())
    prompts = EOS_PROMPTS * 2
    done = _serve_all(eng, prompts, 3, seed=5)
    assert any(end.stopped == "eos" for _, end in done.values())
    for rid, (p, end) in done.items():
        assert end.output_ids == _solo(t, p, rid, Sampling())
    # a request stopped mid-way (a client gone) ends within its round; the others run on, exact
    pool = LanePool(eng, 2)
    out = {}

    def long_one():
        with pool.lane() as lane:
            lane.stop_after = 3
            orig = lane.callback

            def cb(rec):
                orig(rec)
                if isinstance(rec, Round) and rec.index >= 3:
                    lane.stop()
            lane.callback = cb
            out["stopped"] = lane.generate(prompts[1], 40)
            lane.callback = orig

    def other():
        with pool.lane() as lane:
            out["other"] = lane.generate(prompts[3], N)

    threads = [threading.Thread(target=long_one), threading.Thread(target=other)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    a, b = out["stopped"], out["other"]
    assert a.stopped == "stop" and len(a.output_ids) < 40
    assert a.output_ids == _solo(t, prompts[1], a.request_id, Sampling(), 40)[: len(a.output_ids)]
    assert b.output_ids == _solo(t, prompts[3], b.request_id, Sampling())


def test_step_records_round_trip_and_fill_the_timing_csv():
    st = Step(step=3, requests=[[0, 1], [1, 5]], ms=2.5, shared=True)
    assert from_dict(json.loads(json.dumps(to_dict(st)))) == st
    from rakv.records import RequestEnd, RequestStart

    recs = [RequestStart(request_id=0, prompt_tokens=4), RequestStart(request_id=1, prompt_tokens=5), st,
            Step(step=4, requests=[[0, 1], [1, 1], [2, 1]]), RequestEnd(request_id=0, output_ids=[1, 2]),
            RequestEnd(request_id=1, output_ids=[3])]
    rows = {r["request_id"]: r for r in request_rows(recs)}
    assert rows[0]["shared_steps"] == 2 and rows[0]["max_batch"] == 3 and rows[0]["shared_with"] == "1;2"
    assert rows[1]["shared_steps"] == 2


# ----------------------------------------------------------------------------- the server's side
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny import save_tiny

    d = tmp_path_factory.mktemp("batch-model")
    save_tiny(d / "target", "llama", chat=True)
    return d / "target"


def _server(model_dir, tmp_path_factory, *extra):
    from rakv.cli import Run
    from rakv.cli import build_parser
    from rakv.serve import Server

    args = build_parser().parse_args(["serve", "--target", str(model_dir), "--draft", "ngram", "--port", "0",
                                      "--max-new-tokens", "8", *extra])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAKV_CACHE", str(tmp_path_factory.getbasetemp() / "rakv-cache"))
        mp.setenv("RAKV_CONTENTION_CHECK", "0")
        return Server(args, lambda on_record: Run(args, on_record=on_record)).start()


def _post(url, body, path="/v1/completions", headers=None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def test_the_api_key_is_asked_for(model_dir, tmp_path_factory):
    s = _server(model_dir, tmp_path_factory, "--api-key", "sesame")
    try:
        status, r, _ = _post(s.url, {"prompt": "hello there", "max_tokens": 2})
        assert status == 401 and r["error"]["code"] == "invalid_api_key"
        status, _, _ = _post(s.url, {"prompt": "hello there", "max_tokens": 2}, headers={"Authorization": "Bearer nope"})
        assert status == 401
        status, r, _ = _post(s.url, {"prompt": "hello there", "max_tokens": 2},
                             headers={"Authorization": "Bearer sesame"})
        assert status == 200 and r["choices"][0]["text"] is not None
        import openai

        client = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        assert client.completions.create(model=s.service.model, prompt="hi", max_tokens=2).choices
    finally:
        s.close()


def test_past_the_queue_a_429_with_retry_after_and_the_lanes_free_again(model_dir, tmp_path_factory):
    s = _server(model_dir, tmp_path_factory, "--parallel", "1", "--max-queue", "0")
    try:
        held, go = threading.Event(), threading.Event()

        def hold():                             # the one lane busy, as a long request holds it
            with s.service.admit(), s.service.pool.lane():
                held.set()
                go.wait(60)

        th = threading.Thread(target=hold)
        th.start()
        assert held.wait(60)
        status, r, headers = _post(s.url, {"prompt": "hello there", "max_tokens": 2})
        assert status == 429 and int(headers["Retry-After"]) >= 1 and "busy" in r["error"]["message"]
        go.set()
        th.join(60)
        status, _, _ = _post(s.url, {"prompt": "hello there", "max_tokens": 2})
        assert status == 200
    finally:
        s.close()


def _pause_after_first_round(service):
    """Every lane's records pass a hook that holds a request after its first round until released."""
    paused, release = threading.Event(), threading.Event()
    for lane in service.pool.lanes:
        def cb(rec, orig=lane.callback):
            orig(rec)
            if isinstance(rec, Round) and rec.index == 1 and not paused.is_set():
                paused.set()
                release.wait(60)
        lane.callback = cb
    return paused, release


def test_shutdown_ends_an_open_stream_with_an_error_event(model_dir, tmp_path_factory):
    s = _server(model_dir, tmp_path_factory, "--parallel", "2", "--max-new-tokens", "60")
    paused, release = _pause_after_first_round(s.service)
    events = []

    def stream():
        req = urllib.request.Request(s.url + "/v1/completions",
                                     data=json.dumps({"prompt": "a b c d e f", "max_tokens": 60,
                                                      "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])

    th = threading.Thread(target=stream)
    th.start()
    assert paused.wait(60)
    closer = threading.Thread(target=s.close)       # Ctrl-C: the server closes with the stream open
    closer.start()
    while not s.service.closing:
        threading.Event().wait(0.01)
    release.set()
    closer.join(60)
    th.join(60)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "shutting down" in last["error"]["message"]


def test_a_client_gone_mid_stream_frees_its_lane(model_dir, tmp_path_factory):
    from rakv.serve.api import parse_ask

    s = _server(model_dir, tmp_path_factory, "--parallel", "1", "--max-queue", "0")
    try:
        def gone(piece):
            raise BrokenPipeError("the client closed the connection")

        with s.service.admit():
            res = s.service.complete(parse_ask({"prompt": "alpha beta gamma", "max_tokens": 40, "stream": True},
                                               chat=False), emit=gone)
        assert res.end.stopped == "stop" and len(res.end.output_ids) < 40
        assert s.service.pool.busy == 0
        status, _, _ = _post(s.url, {"prompt": "hello there", "max_tokens": 2})    # the lane serves again
        assert status == 200
    finally:
        s.close()


def test_the_adaptive_k_is_priced_by_the_batch_and_stays_exact():
    """Beside other requests an adaptive request's k is re-priced every round (Decision.batch says
    against what); tokens stay each request's solo run."""
    from rakv.records import Decision

    t, d = _pair("llama", "q8" if blockq.library() is not None else "fp32")
    decisions = []
    eng = Engine(t, ModelDraft(d), RakvConfig(policy="adaptive"), profile=synthetic_profile(d=0.05, alpha0=0.9),
                 callback=lambda r: decisions.append(r) if isinstance(r, Decision) else None)
    prompts = _prompts(seed=3)[:8]
    done = _serve_all(eng, prompts, 4, seed=3)
    for rid, (p, end) in done.items():
        assert end.output_ids == _solo(t, p, rid, Sampling())
    priced = [x for x in decisions if x.batch]
    assert priced and all(x.batch["requests"] >= 1 and "k_alone" in x.batch for x in priced)
    moved = [x for x in priced if x.batch.get("joint")]     # in lockstep: the batch's joint move
    assert moved and all(x.batch["joint"] >= 2 and x.action["k"] in (0, x.batch["K"]) for x in moved)


@pytest.mark.parametrize("arch,numerics", [("llama", "q8"), ("llama", "fp32"), ("gpt2", "q8")])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_request_is_decided_by_the_batch_it_joins_and_its_draft_reads_the_prompt_only_to_draft(arch, numerics,
                                                                                                  greedy):
    """A request that joins others takes the batch's k from its start (its per-request Decision carries
    the batch, never a probe beside others); a draft that never drafts for its request never reads
    that prompt (no draft cache lookup); the pool learns the target's pass of n rows from the steps;
    every request's tokens stay its solo run's, greedy and seeded."""
    from rakv.records import CacheLookup, Decision

    if numerics == "q8" and blockq.library() is None:
        pytest.skip(f"no block kernel: {blockq.reason()}")
    t, d = _pair(arch, numerics)
    s = Sampling() if greedy else Sampling(temperature=0.8, top_p=0.95, seed=5)
    recs, pools = [], []
    eng = Engine(t, ModelDraft(d), RakvConfig(policy="adaptive", sampling=s),
                 profile=synthetic_profile(d=0.05, alpha0=0.9), callback=recs.append)
    prompts = _prompts(seed=4)
    done = _serve_all(eng, prompts, 4, seed=4 + greedy, pools=pools)
    for rid, (p, end) in done.items():
        assert end.output_ids == _solo(t, p, rid, s), rid
    first = [r for r in recs if isinstance(r, Decision) and r.round == -1]
    joined = [r for r in first if r.batch]
    assert joined and len(first) == len(prompts)
    assert all(r.reason != "probe" and r.batch["requests"] >= 1 and "k_alone" in r.batch for r in joined)
    read = {r.request_id for r in recs if isinstance(r, CacheLookup) and r.model == "draft"}
    for rid, (_, end) in done.items():
        if end.drafted == 0:
            assert rid not in read, rid                  # its draft never prefilled the prompt
    assert pools[0].view.costs.steps                     # W(n) learned from the shared passes
    assert not pools[0].view.rows                        # every request left the view


def test_a_failed_request_leaves_the_batch():
    """A request that fails inside the engine no longer counts among the batch's requests."""
    t, d = _pair("llama", "fp32")
    eng = Engine(t, ModelDraft(d), RakvConfig(policy="adaptive"), profile=synthetic_profile())
    pool = LanePool(eng, 2)

    def boom(*a, **kw):
        raise RuntimeError("a failing forward")

    with pool.lane() as lane:
        lane._prefill = boom
        with pytest.raises(RuntimeError):
            lane.generate([5, 6, 7], 4)
    assert not pool.view.rows


def test_the_load_generator_against_rakv_serve(model_dir, tmp_path):
    """rakv bench --load rakv: a real `rakv serve --parallel 2` started here, 1 and 2 closed-loop clients
    over loopback; every answer of the two-client run equals the one-client answer to its prompt."""
    from rakv.cli import main

    out = tmp_path / "load"
    assert main(["bench", "--load", "rakv", "--target", str(model_dir), "--draft", "ngram", "--clients", "1,2",
                 "--load-requests", "4", "--max-new-tokens", "6", "--out", str(out)]) == 0
    rows = json.loads((out / "load.json").read_text())["rows"]
    assert [r["clients"] for r in rows] == [1, 2]
    assert all(r["errors"] == 0 and r["tokens"] > 0 and r["differ_from_one_client"] == 0 for r in rows)
    assert (out / "load.md").read_text().startswith("| server |")


def test_a_load_that_changes_against_a_fixed_k_arm(model_dir, tmp_path):
    """rakv bench --load rakv-k2 --load-trace 1:2,2:3: one `rakv serve --policy joint:2` driven by 1 then
    2 closed-loop clients; a row per phase and one over the trace (trace.json, trace.md)."""
    from rakv.cli import main

    out = tmp_path / "trace"
    assert main(["bench", "--load", "rakv-k2", "--load-trace", "1:2,2:3", "--target", str(model_dir), "--draft",
                 "ngram", "--max-new-tokens", "6", "--out", str(out)]) == 0
    rows = json.loads((out / "trace.json").read_text())["rows"]
    assert [(r["phase"], r["clients"], r["requests"]) for r in rows] == [(1, 1, 2), (2, 2, 3), ("all", "1-2", 5)]
    assert all(r["errors"] == 0 and r["tokens"] > 0 and r["server"] == "rakv joint:2 --parallel 2" for r in rows)
    assert (out / "trace.md").read_text().startswith("| server | phase |")


def test_every_step_runs_on_one_thread_the_driver_s_when_one_drives():
    """The steps' forwards start on one thread only (the OpenMP runtime keeps a team per thread that
    starts a region): without a driver a thread of the runner's own, with one (``rakv serve``'s main
    thread) that thread; a lane's tokens are the same either way."""
    t, _ = _pair("llama", "q8")
    eng = Engine(t, None, RakvConfig(policy="ar"), profile=synthetic_profile())
    prompts = _prompts(seed=3)[:6]
    idents: list[int] = []
    pools: list = []
    first = _serve_all(eng, prompts, 3, seed=1, steps=[], pools=pools)
    own = pools[0].batcher.runner

    stop = threading.Event()
    eng2 = Engine(t, None, RakvConfig(policy="ar"), profile=synthetic_profile())
    pool = LanePool(eng2, 3, on_step=lambda info: idents.append(threading.get_ident()))
    driver = threading.Thread(target=pool.batcher.runner.drive, args=(stop,))
    driver.start()
    try:
        done = {}

        def client(i):
            with pool.lane() as lane:
                end = lane.generate(prompts[i], N)
            done[i] = end.output_ids

        cs = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for c in cs:
            c.start()
        for c in cs:
            c.join(300)
    finally:
        stop.set()
        driver.join(30)
    assert idents and set(idents) == {driver.ident}
    assert sorted(done.values()) == sorted(end.output_ids for _, end in first.values())
    assert own._owner is not None and own._owner.name == "rakv-step"


def test_the_runner_hands_over_when_its_driver_stops():
    """A step asked for after the driver stopped runs on a thread of the runner's own (a server's
    open requests finish while it shuts down); a step asked for from the runner's thread runs at once."""
    from rakv.engine.batch import StepRunner

    r = StepRunner()
    stop = threading.Event()
    seen = []
    d = threading.Thread(target=r.drive, args=(stop,))
    d.start()
    r.run(lambda: seen.append(threading.current_thread()))
    stop.set()
    d.join(10)
    r.run(lambda: seen.append(threading.current_thread()))
    r.run(lambda: r.run(lambda: seen.append(threading.current_thread())))    # nested: no deadlock
    assert seen[0] is d and seen[1].name == "rakv-step" and seen[2] is seen[1]
    def boom():
        raise ValueError("in the step")

    with pytest.raises(ValueError, match="in the step"):
        r.run(boom)
    r.run(lambda: seen.append(threading.current_thread()))     # the runner's thread lives on
    assert seen[3] is seen[1]


def test_a_shared_step_carries_its_predicted_ms_and_the_records_keep_it():
    """Each step is priced before it runs (the target's W(n) at the batch's learned scale, the
    draft's passes as its steps), and the Step record round-trips the price."""
    t, d = _pair("llama", "q8")
    eng = Engine(t, ModelDraft(d), RakvConfig(policy="joint:2"), profile=synthetic_profile())
    steps = []
    _serve_all(eng, _prompts(seed=4)[:4], 2, seed=2, steps=steps)
    assert steps and all(st.predicted_ms is not None and st.predicted_ms > 0 for st in steps)
    st = max(steps, key=lambda s: len(s.rows))
    rec = Step(step=st.index, requests=[list(x) for x in st.rows], ms=st.ms, shared=st.shared,
               predicted_ms=st.predicted_ms)
    back = from_dict(json.loads(json.dumps(to_dict(rec))))
    assert back.predicted_ms == st.predicted_ms
    no_profile = Engine(t, None, RakvConfig(policy="ar"))
    steps2 = []
    _serve_all(no_profile, _prompts(seed=4)[:2], 2, seed=2, steps=steps2)
    assert all(st.predicted_ms is None for st in steps2)


def test_lockstep_holds_the_target_s_rows_while_a_draft_s_wait():
    """The rule: a step with a model draft's rows and the target's runs the draft's, and the target's
    wait for the next (any order of arrival; one model's rows alone run at once)."""
    from rakv.engine.batch import lockstep

    class R:
        def __init__(self, backend, tokens=(7,), keep=1):
            self.backend, self.tokens, self.keep, self.tree = backend, list(tokens), keep, None

    T, D = object(), object()
    mixed = [R(T), R(D), R(T, (1, 2, 3), keep=0), R(D)]          # a decode step, a verify
    now, later = lockstep(mixed, T)
    assert [r.backend for r in now] == [D, D] and [r.backend for r in later] == [T, T]
    for alone in ([R(T), R(T)], [R(D)]):
        assert lockstep(alone, T) == (alone, [])
    assert lockstep(mixed, None) == (mixed, [])
    chunk = R(T, range(64))                                        # a new prompt's chunk runs at once
    now, later = lockstep([R(D), chunk, R(T)], T)
    assert chunk in now and len(now) == 2 and len(later) == 1


@pytest.mark.parametrize("greedy", [True, False])
def test_in_lockstep_no_step_pays_both_models_and_drafts_share_passes(greedy):
    """Requests with a model draft: no step runs a pass of the draft and one of the target (the
    target's rows wait while a draft's do) but beside a new prompt's chunk, the lanes' draft tokens
    share the draft's passes and their verifies one pass; every request still its solo run's tokens."""
    if blockq.library() is None:
        pytest.skip(f"no block kernel: {blockq.reason()}")
    t, d = _pair("llama", "q8")
    s = Sampling() if greedy else Sampling(temperature=0.8, top_p=0.95, seed=5)
    eng = Engine(t, ModelDraft(d), RakvConfig(policy="spec:3", sampling=s), profile=synthetic_profile())
    passes = []

    def hook(pool):
        learn = pool.batcher.on_pass

        def on_pass(backend, rows, ctx, ms):
            passes.append((pool.batcher.steps, backend is pool.batcher.last, rows))
            learn(backend, rows, ctx, ms)
        pool.batcher.on_pass = on_pass

    prompts = _prompts(seed=9)[:6]
    steps = []
    done = _serve_all(eng, prompts, 3, seed=3, steps=steps, pools=hook)
    for rid, (p, end) in done.items():
        assert end.output_ids == _solo(t, p, rid, s), rid
    by_step = {}
    for step, is_target, rows in passes:
        by_step.setdefault(step, set()).add(is_target)
    from rakv.engine.batch import PREFILL_CHUNK

    chunks = sum(-(-len(p) // PREFILL_CHUNK) for p in prompts)
    both = sum(len(models) == 2 for models in by_step.values())
    assert both <= chunks < len(by_step) // 4     # both models in a step only beside a new prompt's chunk
    assert any(not is_target and rows >= 2 for _, is_target, rows in passes)   # drafts shared a pass
    assert any(len(st.rows) >= 2 and all(n == 4 for _, n in st.rows) for st in steps)   # verifies in one pass
