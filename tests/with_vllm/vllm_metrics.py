"""A vLLM server's /metrics text, as vLLM 0.32 (V1 engine) writes it, for tests.

Metric names, HELP texts and label names are vLLM's (vllm/v1/metrics/loggers.py and
vllm/v1/spec_decode/metrics.py: labels ``model_name`` and ``engine``, ``position`` for the
per-position counter, ``finished_reason`` for request_success); the layout is prometheus_client's
``generate_latest`` (0.26): counters named ``..._total`` with their ``# HELP`` / ``# TYPE`` lines,
labels sorted, then the ``_created`` gauges; histograms as ``_bucket`` / ``_count`` / ``_sum``.
Also a serving test helper: a real HTTP server on a free loopback port whose text can change
between polls and which logs every request's method and path.
"""

from __future__ import annotations

import http.server
import threading

MODEL = "/models/Qwen2.5-0.5B-Instruct"
CREATED = 1.7683e09
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


def _go(v: float) -> str:
    """prometheus_client's floatToGoString (utils.py, 0.26)."""
    d = float(v)
    if d == float("inf"):
        return "+Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _counter(out: list, name: str, doc: str, series: list[tuple[dict, float]]) -> None:
    out.append(f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n")
    for labels, v in series:
        lab = ",".join(f'{k}="{labels[k]}"' for k in sorted(labels))
        out.append(f"{name}_total{{{lab}}} {_go(v)}\n")
    out.append(f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n")
    for labels, _ in series:
        lab = ",".join(f'{k}="{labels[k]}"' for k in sorted(labels))
        out.append(f"{name}_created{{{lab}}} {_go(CREATED)}\n")


def metrics_text(*, drafts=0.0, draft_tokens=0.0, accepted=0.0, per_pos=(), queries=0.0, hits=0.0, cached=None,
                 prompt=0.0, generation=0.0, success=0.0, itl=(), engines=("0",), model=MODEL, spec=True) -> str:
    """The /metrics text of a server whose counters are these (split evenly over ``engines``).
    ``itl``: the inter-token latencies observed so far (seconds). ``spec=False``: no speculative
    config (vLLM then has no spec_decode metrics at all)."""
    n = len(engines)
    lab = [{"engine": e, "model_name": model} for e in engines]
    out = ["# HELP python_gc_objects_collected_total Objects collected during gc\n",
           "# TYPE python_gc_objects_collected_total counter\n",
           'python_gc_objects_collected_total{generation="0"} 12345.0\n',
           "# HELP process_resident_memory_bytes Resident memory size in bytes.\n",
           "# TYPE process_resident_memory_bytes gauge\n",
           "process_resident_memory_bytes 1.23456789e+09\n",
           "# HELP vllm:num_requests_running Number of requests in model execution batches.\n",
           "# TYPE vllm:num_requests_running gauge\n"]
    out += [f'vllm:num_requests_running{{engine="{e}",model_name="{model}"}} 0.0\n' for e in engines]
    out += ["# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n",
            "# TYPE vllm:kv_cache_usage_perc gauge\n"]
    out += [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="{model}"}} 0.0\n' for e in engines]
    _counter(out, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             [(d, queries / n) for d in lab])
    _counter(out, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             [(d, hits / n) for d in lab])
    _counter(out, "vllm:prompt_tokens", "Number of prefill tokens processed.", [(d, prompt / n) for d in lab])
    _counter(out, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             [(d, (hits if cached is None else cached) / n) for d in lab])
    _counter(out, "vllm:generation_tokens", "Number of generation tokens processed.",
             [(d, generation / n) for d in lab])
    _counter(out, "vllm:request_success", "Count of successfully processed requests.",
             [({**d, "finished_reason": r}, (success / n if r == "length" else 0.0))
              for d in lab for r in ("stop", "length", "abort", "error", "repetition")])
    # the inter-token latency histogram
    out.append("# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.\n"
               "# TYPE vllm:inter_token_latency_seconds histogram\n")
    for e in engines:
        for le in ITL_BUCKETS + (float("inf"),):
            c = sum(1 for x in itl if x <= le) / n
            out.append(f'vllm:inter_token_latency_seconds_bucket{{engine="{e}",le="{_go(le)}",model_name="{model}"}} '
                       f"{_go(c)}\n")
        out.append(f'vllm:inter_token_latency_seconds_count{{engine="{e}",model_name="{model}"}} {_go(len(itl) / n)}\n')
        out.append(f'vllm:inter_token_latency_seconds_sum{{engine="{e}",model_name="{model}"}} {_go(sum(itl) / n)}\n')
    out.append("# HELP vllm:inter_token_latency_seconds_created Histogram of inter-token latency in seconds.\n"
               "# TYPE vllm:inter_token_latency_seconds_created gauge\n")
    out += [f'vllm:inter_token_latency_seconds_created{{engine="{e}",model_name="{model}"}} {_go(CREATED)}\n'
            for e in engines]
    if spec:
        _counter(out, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", [(d, drafts / n) for d in lab])
        _counter(out, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                 [(d, draft_tokens / n) for d in lab])
        _counter(out, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                 [(d, accepted / n) for d in lab])
        _counter(out, "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                 [({**d, "position": str(j)}, a / n) for d in lab for j, a in enumerate(per_pos)])
    return "".join(out)


def state(drafts: int, per_pos: list[int], k: int, **kw) -> dict:
    """Counters of ``drafts`` drafts of ``k`` tokens with ``per_pos`` accepted at each position."""
    return dict(drafts=drafts, draft_tokens=drafts * k, accepted=sum(per_pos), per_pos=per_pos, **kw)


class MetricsServer:
    """A real HTTP server on 127.0.0.1 (a free port) answering GET /metrics with ``text`` (settable),
    404 elsewhere; every request's (method, path) is logged, POST and the rest answered 405."""

    def __init__(self, text: str = ""):
        self.text = text
        self.down = False           # True: every request answered 503 (a server that went away behind a proxy)
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _log(self):
                with outer.lock:
                    outer.requests.append((self.command, self.path))

            def do_GET(self):       # noqa: N802
                self._log()
                if outer.down:
                    self.send_error(503)
                    return
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = outer.text.encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self):
                self._log()
                self.send_error(405)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _refuse     # noqa: N815

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def polls(self) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == "GET" and p == "/metrics")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
