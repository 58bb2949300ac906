"""rakv/integrations/vllm_watch.py: a vLLM server's /metrics scrapes turned into records and deltas.

The texts are vLLM 0.32's /metrics as prometheus_client writes them (tests/with_vllm/vllm_metrics.py); no
vLLM runs here. Qt-free."""

from __future__ import annotations

import json

import pytest

from rakv.integrations import vllm_watch as VW
from rakv.integrations.vllm_advise import acceptance, parse_prometheus, spec_counters
from rakv.decide.policy import alpha_star
from rakv.decide.profile import verify_costs
from tests.with_vllm.vllm_metrics import MetricsServer, metrics_text, state

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

S0 = state(100, [60, 45, 30, 15], 4, queries=1000, hits=250, prompt=1000, generation=400, success=5,
           itl=[0.02] * 10)
S1 = state(150, [100, 80, 50, 20], 4, queries=1400, hits=550, prompt=1400, generation=650, success=8,
           itl=[0.02] * 10 + [0.03] * 10)


def test_one_scrape_sums_engines_and_matches_advise():
    text = metrics_text(**S0, engines=("0", "1"))
    c = VW.counters(text)
    assert (c.drafts, c.draft_tokens, c.accepted) == (100, 400, 150)
    assert c.per_pos == (60, 45, 30, 15) and c.k == 4 and c.speculating
    assert (c.prefix_queries, c.prefix_hits, c.prompt_cached) == (1000, 250, 250)
    assert (c.prompt_tokens, c.generation_tokens, c.requests) == (1000, 400, 5)
    assert c.per_position == [0.6, 0.45, 0.3, 0.15]                     # vLLM's own per-position rate
    assert c.conditional == [0.6, 0.75, 0.6667, 0.5]                    # given the one before accepted
    assert c.alpha == round(150 / (100 + 60 + 45 + 30), 4)              # pooled: sum a_j / sum a_(j-1)
    assert c.mean_accepted == 1.5 and c.draft_acceptance == 0.375 and c.hit_rate == 0.25
    assert c.itl_ms == pytest.approx(20.0)
    assert c.models == ("/models/Qwen2.5-0.5B-Instruct",)
    # the same numbers as `rakv advise --engine vllm --metrics` reads
    a = acceptance(spec_counters(parse_prometheus(text)))
    assert (a["alpha"], a["per_position"], a["mean_accepted"], a["prefix_hit_rate"]) == (
        c.alpha, c.conditional, c.mean_accepted, c.hit_rate)
    json.dumps(c.to_dict())                                              # plain data


def test_name_variants_labels_and_created_samples():
    text = ("# TYPE vllm:spec_decode_num_drafts counter\n"
            'vllm:spec_decode_num_drafts{model_name="a",engine="0"} 10\n'              # no _total (OpenMetrics)
            'vllm:spec_decode_num_drafts_created{model_name="a",engine="0"} 1.7e+09\n'  # a timestamp: ignored
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="b"} 30.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",model_name="a",position="1"} 4\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="b",position="0"} 20\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="b",position="1"} 6\n'
            'vllm:prefix_cache_queries{engine="0",model_name="a"} 50\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="a"} 5\n'
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="a"} 2.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="a"} 3.0\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="a",source="local_compute"} 99.0\n'
            'vllm:request_prompt_tokens_sum{engine="0",model_name="a"} 77.0\n')
    c = VW.counters(text)
    assert c.drafts == 40 and c.per_pos == (20, 10) and c.prefix_queries == 50 and c.prefix_hits == 5
    assert c.requests == 5 and c.prompt_tokens == 0                     # by_source and histograms are not these
    assert c.models == ("a", "b")
    assert VW.base_name("vllm:prefix_cache_hits_total") == "prefix_cache_hits"
    assert VW.base_name("vllm:prefix_cache_hits_created") is None and VW.base_name("process_cpu_seconds_total") is None


def test_no_speculation_and_not_vllm():
    c = VW.counters(metrics_text(queries=300, hits=30, spec=False))
    assert not c.speculating and c.k == 0 and c.alpha is None and c.mean_accepted is None
    assert c.hit_rate == 0.1
    with pytest.raises(ValueError, match="no vllm: metrics"):
        VW.counters("# HELP go_goroutines x\n# TYPE go_goroutines gauge\ngo_goroutines 7\n")


def test_watch_deltas_between_polls():
    w = VW.Watch()
    r1 = w.update(metrics_text(**S0), t=0.0)
    assert r1.poll == 1 and r1.delta is None and not r1.restarted and r1.total.drafts == 100
    r2 = w.update(metrics_text(**S1), t=1.0)
    d = r2.delta
    assert r2.poll == 2 and r2.t == 1.0 and not r2.restarted
    assert (d.drafts, d.draft_tokens, d.accepted) == (50, 200, 100)
    assert d.per_pos == (40, 35, 20, 5)
    assert d.per_position == [0.8, 0.7, 0.4, 0.1]
    assert d.alpha == round(100 / (50 + 40 + 35 + 20), 4)
    assert d.mean_accepted == 2.0
    assert (d.prefix_queries, d.prefix_hits) == (400, 300) and d.hit_rate == 0.75
    assert (d.generation_tokens, d.requests) == (250, 3)
    assert d.itl_ms == pytest.approx(30.0)                              # this interval's tokens only
    r3 = w.update(metrics_text(**S1), t=2.0)                           # nothing happened
    assert r3.delta.drafts == 0 and r3.delta.alpha is None and r3.delta.hit_rate is None


def test_counters_going_down_is_a_restart():
    w = VW.Watch()
    w.update(metrics_text(**S1))
    r = w.update(metrics_text(**state(3, [2, 1, 0, 0], 4, queries=20, hits=0)), t=5.0)
    assert r.restarted and r.restarts == 1 and r.delta is None and r.total.drafts == 3
    r = w.update(metrics_text(**state(13, [9, 5, 2, 0], 4, queries=60, hits=20)), t=6.0)
    assert not r.restarted and r.delta.drafts == 10 and r.delta.per_pos == (7, 4, 2, 0) and r.delta.hit_rate == 0.5
    # a server without speculation now (its spec_decode counters vanished): a restart too
    r = w.update(metrics_text(queries=100, hits=50, spec=False))
    assert r.restarted and r.restarts == 2 and not r.total.speculating
    # fewer positions (another num_speculative_tokens) with higher counts: also another server
    w2 = VW.Watch()
    w2.update(metrics_text(**state(10, [5, 3, 1, 0], 4)))
    assert w2.update(metrics_text(**state(20, [9, 4], 2))).restarted


def test_metrics_url():
    assert VW.metrics_url("127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert VW.metrics_url(" http://h:8000/v1/ ") == "http://h:8000/metrics"
    assert VW.metrics_url("http://h:8000/metrics") == "http://h:8000/metrics"
    assert VW.metrics_url("https://gw.example/vllm") == "https://gw.example/vllm/metrics"
    for bad, words in (("", "no server URL"), ("ftp://h:1", "only http"), ("http://h:port", "bad port"),
                       ("http://:80", "no host")):
        with pytest.raises(ValueError, match=words):
            VW.metrics_url(bad)


def test_crossover_from_a_calibrate_profile(tmp_path):
    prof = {"engine": "vllm", "t_ms": 20.0, "V_ms": {"1": 21.0, "2": 22.5, "4": 25.0, "8": 33.0},
            "cpu_ms": {}, "samples_ms": {}}                            # as vllm_run.calibrate writes it
    p = tmp_path / "vllm-profile.json"
    p.write_text(json.dumps(prof))
    cx = VW.crossover(str(p))
    V = verify_costs(prof, 8)
    assert cx.t_ms == 20.0 and cx.V_ms[4] == 25.0 and cx.V_ms[3] == pytest.approx(23.75)
    assert cx.alpha_star == alpha_star(V) and cx.measured_ks == (1, 2, 4, 8)
    assert 0 < cx.star(4) < 1
    assert "10" in VW.crossover(str(p), 10).alpha_star
    (tmp_path / "bad.json").write_text('{"V_ms": {}}')
    with pytest.raises(ValueError, match="not a vLLM cost profile"):
        VW.crossover(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="cannot read"):
        VW.crossover(str(tmp_path / "missing.json"))


def test_fetch_is_a_get_of_metrics():
    srv = MetricsServer(metrics_text(**S0))
    try:
        text = VW.fetch(VW.metrics_url(srv.url))
        assert VW.counters(text).drafts == 100
        assert srv.requests == [("GET", "/metrics")]
    finally:
        srv.close()
