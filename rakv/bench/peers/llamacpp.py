"""The llama.cpp peers: llama.cpp's own tools on the same GGUF files (``rakv bench --peer-llama-cpp``,
``LlamaCppToolsPeer``), and llama-cpp-python on a GGUF of the target's weights (``--peer-gguf``,
``LlamaCppPeer``).

llama.cpp's tools: two kinds of arm, run as subprocesses on each request of the stream, interleaved with our policies
(they are arms of the same Williams order, request by request):

  llama.cpp:ar        ``llama-completion`` (``llama-cli`` on older trees): plain greedy decoding
                      (``-no-cnv --temp 0 -n N -t THREADS -f PROMPT_FILE --no-escape``)
  llama.cpp:spec:N    ``llama-speculative-simple -m TARGET -md DRAFT --spec-type draft-simple
                      --spec-draft-n-max N --temp 0``: speculative decoding with the same draft
                      file, at most N drafted tokens a round (one arm per --llama-cpp-draft-lengths)

The prompt is the text of the request's ids as our bench built them (through the chat template
unless ``--raw``), decoded with the special tokens kept; llama.cpp tokenizes it itself, parsing the
special tokens (its prompt token count is recorded next to ours: ``peer_prompt_tokens``). Same
max new tokens, same thread count (torch's), ``-c 4096``. Times are llama.cpp's own, read from its
log (model loading excluded, as ours excludes it): ``llama.cpp:ar`` latency = prompt eval + eval,
TTFT = prompt eval; ``llama.cpp:spec:N`` latency = encoded + decoded time (no TTFT: the tool does
not report one), output tokens = its ``n_predict`` (it stops once past N, so it can pass N by up to a
round's accepted drafts: compare rates, not latencies). Its output text is tokenized with the target's tokenizer for ``output_tokens``
where the tool gives no count, and compared with ``ar``'s text (``text_match``; ``match`` is -1,
not compared: another program's arithmetic).

Build the tools with ``bash scripts/build_llama_cpp.sh`` (into the cache dir's
``llama.cpp/<version>/build/bin``) or point ``--llama-cpp-dir`` at a folder holding them.

llama-cpp-python (``llama_cpp``: the ``peers`` extra, never required), the ``llama.cpp`` arm: on a
GGUF of the target's weights given with ``--peer-gguf`` (e.g. an F32 one from llama.cpp's
``convert_hf_to_gguf.py --outtype f32``): greedy (top_k 1), the same prompt ids, no draft; its TTFT
is the first token's arrival.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .base import Peer, ids_row

BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
DEFAULT_VERSION = "0.3.36"
DRAFT_LENGTHS = (2, 4, 8, 16)
CTX = 4096
PREFIX = "llama.cpp:"
AR_ARM = PREFIX + "ar"
TIMEOUT_S = 600


class LlamaCppMissing(ValueError):
    """The llama.cpp tools are not where they were looked for (one line naming the build script)."""


class LlamaCppFailed(RuntimeError):
    """A llama.cpp tool exited non-zero or printed no timings (one line, with its last log line)."""


# ----------------------------------------------------------------------------- finding the tools
@dataclass(frozen=True)
class Tools:
    folder: Path
    completion: Path
    speculative: Path
    bench: Path | None = None


def default_dirs() -> list[Path]:
    """Where scripts/build_llama_cpp.sh puts the tools, newest version first."""
    from rakv.util.paths import cache_dir

    root = cache_dir() / "llama.cpp"
    found = sorted((p / "build" / "bin" for p in root.glob("*") if (p / "build" / "bin").is_dir()),
                   key=lambda p: _version_key(p.parents[1].name), reverse=True)
    return found or [root / DEFAULT_VERSION / "build" / "bin"]


def _version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.\-]", v))


def _exe(folder: Path, name: str) -> Path | None:
    for n in (name, name + ".exe"):
        p = folder / n
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def find_tools(folder: str | os.PathLike | None = None) -> Tools:
    """The tools in ``folder`` (default: the build script's output); LlamaCppMissing where absent."""
    dirs = [Path(folder).expanduser()] if folder else default_dirs()
    for d in dirs:
        comp = _exe(d, "llama-completion") or _exe(d, "llama-cli")
        spec = _exe(d, "llama-speculative-simple")
        if comp and spec:
            return Tools(d, comp, spec, _exe(d, "llama-bench"))
    where = dirs[0]
    raise LlamaCppMissing(f"--peer-llama-cpp: no llama-completion (or llama-cli) and llama-speculative-simple in "
                          f"{where}; build them with `bash {BUILD_SCRIPT}` or pass --llama-cpp-dir DIR")


# ----------------------------------------------------------------------------- parsing the logs
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*" + _NUM + r"\s*ms\s*/\s*(\d+)\s*tokens")
_EVAL = re.compile(r"(?<!prompt )eval time\s*=\s*" + _NUM + r"\s*ms\s*/\s*(\d+)\s*runs")
_ENCODED = re.compile(r"encoded\s+(\d+)\s+tokens in\s+" + _NUM + r"\s*seconds")
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+" + _NUM + r"\s*seconds, speed:\s*" + _NUM + r"\s*t/s")
_SPEC_INT = {k: re.compile(rf"\b{k}\s*=\s*(\d+)") for k in ("n_draft", "n_predict", "n_drafted", "n_accept")}
_ACCEPT = re.compile(r"\baccept\s*=\s*" + _NUM + r"\s*%")


@dataclass
class CompletionTimes:
    """llama-completion's (or llama-cli's) perf lines: the target context's, the first of each kind."""
    prompt_ms: float
    prompt_tokens: int
    eval_ms: float
    eval_runs: int

    @property
    def latency_ms(self) -> float:
        return self.prompt_ms + self.eval_ms

    @property
    def decode_tps(self) -> float:
        return self.eval_runs / (self.eval_ms / 1e3) if self.eval_ms > 0 else 0.0


@dataclass
class SpeculativeTimes:
    """llama-speculative-simple's summary lines."""
    encoded_tokens: int
    encode_s: float
    decoded_tokens: int
    decode_s: float
    decode_tps: float
    n_draft: int | None = None
    n_predict: int | None = None
    n_drafted: int = 0
    n_accept: int = 0
    accept_pct: float | None = None

    @property
    def latency_ms(self) -> float:
        return (self.encode_s + self.decode_s) * 1e3

    @property
    def acceptance(self) -> float | None:
        return self.n_accept / self.n_drafted if self.n_drafted else None


def parse_completion(log: str) -> CompletionTimes:
    """The timing lines of a llama-completion run ("prompt eval time = X ms / N tokens", "eval time =
    X ms / M runs"). LlamaCppFailed when they are missing."""
    p, e = _PROMPT_EVAL.search(log), _EVAL.search(log)
    if not p or not e:
        raise LlamaCppFailed(f"no timing lines in llama.cpp's output ({_last_line(log)})")
    return CompletionTimes(float(p.group(1)), int(p.group(2)), float(e.group(1)), int(e.group(2)))


def parse_speculative(log: str) -> SpeculativeTimes:
    """llama-speculative-simple's "encoded N tokens in X seconds", "decoded N tokens in X seconds,
    speed: Y t/s", n_draft, n_predict, n_drafted, n_accept and accept lines."""
    enc, dec = _ENCODED.search(log), _DECODED.search(log)
    if not enc or not dec:
        raise LlamaCppFailed(f"no encoded/decoded lines in llama-speculative-simple's output ({_last_line(log)})")
    ints = {k: (int(m.group(1)) if (m := rx.search(log)) else None) for k, rx in _SPEC_INT.items()}
    acc = _ACCEPT.search(log)
    return SpeculativeTimes(int(enc.group(1)), float(enc.group(2)), int(dec.group(1)), float(dec.group(2)),
                            float(dec.group(3)), ints["n_draft"], ints["n_predict"], ints["n_drafted"] or 0,
                            ints["n_accept"] or 0, float(acc.group(1)) if acc else None)


def _last_line(log: str) -> str:
    lines = [x.strip() for x in (log or "").splitlines() if x.strip()]
    return lines[-1][:200] if lines else "no output"


# ----------------------------------------------------------------------------- running the tools
@dataclass
class PeerRun:
    text: str
    latency_ms: float
    ttft_ms: float | None
    decode_tps: float
    prompt_tokens: int
    output_tokens: int | None          # as the tool counts them (None: it does not say)
    drafted: int | None = None
    accepted: int | None = None
    wall_ms: float = 0.0               # the subprocess, loading included
    extra: dict = field(default_factory=dict)


def completion_cmd(tools: Tools, target: str, prompt_file: str, n: int, threads: int) -> list[str]:
    cmd = [str(tools.completion), "-m", target, "-f", prompt_file, "-n", str(n), "--temp", "0", "--top-k", "1",
           "--repeat-penalty", "1.0", "-t", str(threads), "-tb", str(threads), "-c", str(CTX), "--no-escape",
           "--no-display-prompt", "-ngl", "0", "--seed", "0"]
    if tools.completion.name.startswith("llama-completion") or tools.completion.name.startswith("llama-cli"):
        cmd.append("-no-cnv")
    return cmd


def speculative_cmd(tools: Tools, target: str, draft: str, prompt_file: str, n: int, threads: int,
                    n_max: int) -> list[str]:
    return [str(tools.speculative), "-m", target, "-md", draft, "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(n_max), "--temp", "0", "--top-k", "1", "-n", str(n), "-f", prompt_file,
            "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads), "-c", str(CTX),
            "--no-escape", "-ngl", "0", "-ngld", "0", "--seed", "0"]


def _run(cmd: list[str]) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LlamaCppFailed(f"{Path(cmd[0]).name} ran past {TIMEOUT_S} s") from None
    wall = (time.perf_counter() - t0) * 1e3
    out, err = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    if r.returncode != 0:
        raise LlamaCppFailed(f"{Path(cmd[0]).name} exited {r.returncode}: {_last_line(err or out)}")
    return out, err, wall


def _prompt_file(prompt: str) -> str:
    fd, path = tempfile.mkstemp(prefix="rakv-llama-prompt-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(prompt)
    return path


def run_completion(tools: Tools, target: str, prompt: str, n: int, threads: int) -> PeerRun:
    path = _prompt_file(prompt)
    try:
        out, err, wall = _run(completion_cmd(tools, target, path, n, threads))
    finally:
        os.unlink(path)
    t = parse_completion(err + "\n" + out)
    return PeerRun(text=_strip_tail(out), latency_ms=t.latency_ms, ttft_ms=t.prompt_ms, decode_tps=t.decode_tps,
                   prompt_tokens=t.prompt_tokens, output_tokens=t.eval_runs + 1, wall_ms=wall,
                   extra={"eval_runs": t.eval_runs, "eval_ms": t.eval_ms, "prompt_ms": t.prompt_ms})


def run_speculative(tools: Tools, target: str, draft: str, prompt: str, n: int, threads: int, n_max: int) -> PeerRun:
    path = _prompt_file(prompt)
    try:
        out, err, wall = _run(speculative_cmd(tools, target, draft, path, n, threads, n_max))
    finally:
        os.unlink(path)
    t = parse_speculative(err + "\n" + out)
    return PeerRun(text=_spec_text(out, prompt), latency_ms=t.latency_ms, ttft_ms=None, decode_tps=t.decode_tps,
                   prompt_tokens=t.encoded_tokens, output_tokens=t.n_predict, drafted=t.n_drafted,
                   accepted=t.n_accept, wall_ms=wall,
                   extra={"decode_s": t.decode_s, "encode_s": t.encode_s, "accept_pct": t.accept_pct})


def _strip_tail(out: str) -> str:
    """llama-completion's stdout: the generated text, then " [end of text]" at an end of generation."""
    return re.sub(r"\s*\[end of text\]\s*$", "", out)


def _spec_text(out: str, prompt: str) -> str:
    """llama-speculative-simple prints "\\n\\n", the prompt, the generated text, "\\n\\n" on stdout."""
    s = out[2:] if out.startswith("\n\n") else out
    for p in (prompt, prompt.rstrip()):       # (the echo can lack the prompt's last newline)
        if p and s.startswith(p):
            s = s[len(p):]
            break
    return s[:-2] if s.endswith("\n\n") else s


# ----------------------------------------------------------------------------- the bench's peer
@dataclass
class LlamaCppCli:
    """What --peer-llama-cpp configured: the tools, the target's and draft's GGUF files, the draft lengths."""
    tools: Tools
    target_gguf: str
    draft_gguf: str | None
    draft_lengths: tuple[int, ...] = DRAFT_LENGTHS

    def arm_names(self) -> list[str]:
        return [AR_ARM] + ([f"{PREFIX}spec:{n}" for n in self.draft_lengths] if self.draft_gguf else [])

    def run(self, arm: str, prompt: str, n: int, threads: int) -> PeerRun:
        if arm == AR_ARM:
            return run_completion(self.tools, self.target_gguf, prompt, n, threads)
        if arm.startswith(PREFIX + "spec:") and self.draft_gguf:
            return run_speculative(self.tools, self.target_gguf, self.draft_gguf, prompt, n, threads,
                                   int(arm.rsplit(":", 1)[1]))
        raise ValueError(f"unknown llama.cpp arm {arm!r}")


def is_arm(name: str) -> bool:
    return name.startswith(PREFIX) and name != "llama.cpp"


def gguf_of(spec: str | None) -> str | None:
    """The GGUF file a --target / --draft value stands for: a preset's assembled file (assembled now
    if need be) or a .gguf path; None for anything else (a hub id, a folder, demo, int8, ngram ...)."""
    from rakv.load.presets import PRESETS, ensure_preset

    s = (spec or "").strip()
    if s in PRESETS:
        return str(ensure_preset(s))
    if s.lower().endswith(".gguf") and Path(s).expanduser().is_file():
        return str(Path(s).expanduser().resolve())
    return None


def parse_lengths(text: str | None) -> tuple[int, ...]:
    if text is None or not str(text).strip():
        return DRAFT_LENGTHS
    try:
        xs = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"bad --llama-cpp-draft-lengths {text!r}: expected comma-separated integers") from None
    if not xs or any(x < 1 or x > 64 for x in xs):
        raise ValueError(f"bad --llama-cpp-draft-lengths {text!r}: expected integers from 1 to 64")
    return tuple(xs)


def configure(args) -> LlamaCppCli | None:
    """--peer-llama-cpp's settings, checked before any model loads (ValueError: one line, exit 2)."""
    if not getattr(args, "peer_llama_cpp", False):
        if getattr(args, "llama_cpp_dir", None) or getattr(args, "llama_cpp_draft_lengths", None):
            raise ValueError("--llama-cpp-dir and --llama-cpp-draft-lengths need --peer-llama-cpp")
        return None
    lengths = parse_lengths(getattr(args, "llama_cpp_draft_lengths", None))
    tools = find_tools(getattr(args, "llama_cpp_dir", None))
    target = gguf_of(args.target)
    if target is None:
        raise ValueError(f"--peer-llama-cpp needs a GGUF target (a preset such as qwen-coder-1.5b, or a .gguf "
                         f"file), not {args.target!r}")
    return LlamaCppCli(tools, target, gguf_of(args.draft), lengths)


def meta_of(lc: LlamaCppCli | None, args) -> dict | None:
    """What the llama.cpp tools ran: the tools, the files, the draft lengths, how the prompt was sent."""
    if lc is None:
        return None
    return dict(tools=str(lc.tools.folder), completion=lc.tools.completion.name, target_gguf=lc.target_gguf,
                draft_gguf=lc.draft_gguf, draft_lengths=list(lc.draft_lengths) if lc.draft_gguf else [],
                prompt=("the text of the ids our bench feeds every policy (decoded with the special tokens kept, "
                        "parsed by llama.cpp), " + ("raw" if args.raw else "through the chat template where "
                                                    "the workload uses it")),
                greedy=True)


class LlamaCppToolsPeer(Peer):
    """llama.cpp's tools as arms (--peer-llama-cpp): subprocesses, their text compared with ar's."""

    name = "llama.cpp's tools"
    own_process = True
    compare = "text"

    def __init__(self):
        self.cli: LlamaCppCli | None = None

    def add_args(self, ap) -> None:
        ap.add_argument("--peer-llama-cpp", action="store_true",
                        help="add llama.cpp's own tools as peers on the same GGUF files, request by request: "
                             "llama.cpp:ar (llama-completion, greedy) and llama.cpp:spec:N (llama-speculative-simple "
                             "with the draft's file); needs a GGUF target (a preset or .gguf) and the tools "
                             f"(bash {BUILD_SCRIPT})")
        ap.add_argument("--llama-cpp-dir", default=None, metavar="DIR",
                        help="the folder holding llama-completion (or llama-cli) and llama-speculative-simple "
                             "(default: the build script's, in the cache dir)")
        ap.add_argument("--llama-cpp-draft-lengths", default=None, metavar="LIST",
                        help="llama.cpp:spec:N arms, N = --spec-draft-n-max (default 2,4,8,16)")

    def configure(self, args, policies) -> None:
        if getattr(args, "peer_llama_cpp", False) and args.temperature:
            raise ValueError("--peer-llama-cpp runs llama.cpp greedy: use it with --temperature 0")
        self.cli = configure(args)          # tools and GGUF files found (or one line) before any model loads

    def owns(self, arm: str) -> bool:
        return is_arm(arm)

    def added_arms(self, args, draft) -> list[str]:
        if self.cli is None:
            return []
        if self.cli.draft_gguf is None:
            from rakv.util.paths import log

            log(f"--peer-llama-cpp: the draft {args.draft!r} is no GGUF file, so llama.cpp runs without "
                "speculation (llama.cpp:ar only)")
        return self.cli.arm_names()

    def run(self, arm: str, req, ctx) -> dict:
        """One tool run on the request's text, the same max new tokens."""
        import torch

        tok = ctx.target.tokenizer
        prompt = tok.decode(list(req.ids), skip_special_tokens=False)
        res = self.cli.run(arm, prompt, req.gen, torch.get_num_threads())
        ids = list(tok(res.text, add_special_tokens=False)["input_ids"]) if res.text else []
        n = res.output_tokens if res.output_tokens is not None else len(ids)
        return dict(latency_ms=round(res.latency_ms, 3), ttft_ms="" if res.ttft_ms is None else round(res.ttft_ms, 3),
                    tokens_per_s=round(n / (res.latency_ms / 1e3), 3) if res.latency_ms else 0.0, output_tokens=n,
                    drafted="" if res.drafted is None else res.drafted,
                    accepted="" if res.accepted is None else res.accepted, rounds="", mean_accept_len="",
                    alpha_req=round(res.accepted / res.drafted, 4) if res.drafted else "", hit_tokens=0,
                    exact_repeat=0, reuse=0, k="", mean_k="", predicted_ms="",
                    stopped="eos" if n < req.gen else "max_new_tokens", _ids=ids, _text=res.text,
                    decode_tps=round(res.decode_tps, 3), peer_prompt_tokens=res.prompt_tokens,
                    peer_wall_ms=round(res.wall_ms, 1))

    def meta(self, args) -> dict:
        return {"llama_cpp": meta_of(self.cli, args)}


class LlamaCppPeer(Peer):
    """llama-cpp-python on --peer-gguf (the ``llama.cpp`` arm), loaded once per thread count (torch's,
    so both sides get the same cores)."""

    name = "llama.cpp"
    arm_names = ("llama.cpp",)

    def __init__(self):
        self.gguf: str | None = None
        self._llm = None
        self._threads = None

    def add_args(self, ap) -> None:
        ap.add_argument("--peer-gguf", default=None, metavar="FILE",
                        help="a GGUF of the target's weights: adds the llama.cpp peer (needs llama-cpp-python)")

    def configure(self, args, policies) -> None:
        if args.peer_gguf is not None and not Path(args.peer_gguf).expanduser().is_file():
            raise ValueError(f"--peer-gguf {args.peer_gguf}: no such file")
        self.gguf, self._llm, self._threads = (str(Path(args.peer_gguf).expanduser()) if args.peer_gguf else None,
                                               None, None)
        why = self.available() if "llama.cpp" in (policies or []) else None
        if why:
            raise ValueError(why)

    def available(self) -> str | None:
        """Why the llama.cpp peer cannot run (None: it can)."""
        if not self.gguf:
            return "the llama.cpp peer needs --peer-gguf FILE (a GGUF of the target's weights)"
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an import that fails on a missing shared library too
            return f"the llama.cpp peer needs llama-cpp-python (pip install 'rakv-explorer[peers]'): {e}"
        return None

    def why_not(self, arm: str, draft) -> str | None:
        return self.available()

    def default_arms(self, draft) -> list[str]:
        return list(self.arm_names) if self.available() is None else []

    def llm(self):
        import torch

        threads = torch.get_num_threads()
        if self._llm is None or self._threads != threads:
            from llama_cpp import Llama

            self._llm = Llama(model_path=self.gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False)
            self._threads = threads
        return self._llm

    def run(self, arm: str, req, ctx) -> dict:
        from rakv.util.device import clock as now

        llm = self.llm()
        eos = set(ctx.target.eos_ids)
        out: list[int] = []
        t0 = now()
        ttft = 0.0
        for tok in llm.generate(list(req.ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            if not out:
                ttft = (now() - t0) * 1e3
            out.append(int(tok))
            if tok in eos or len(out) >= req.gen:
                break
        return ids_row(out, (now() - t0) * 1e3, ttft, req.gen)
