"""A hostile user's run: 200+ damaged inputs through the CLI (and a few through the explorer), each
recorded as exit code, its error lines, and whether a traceback, a hang or a changed input file
happened. Tiny random models (tests/tiny.py), no network.

    PYTHONPATH=. QT_QPA_PLATFORM=offscreen python scripts/hostile_run.py --out /tmp/hostile

writes OUT/cases.jsonl (one object a case) and OUT/summary.md (the outcome counts per group and
the cases, the table in docs/hostile.md). A few minutes on 2 cores (most cases load a tiny model
once; the GGUF and explorer cases run in their own processes). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HANG_S = 120
DEEP = "[" * 100_000 + "]" * 100_000


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


class Runner:
    def __init__(self, out: Path):
        self.out = out
        self.work = out / "work"
        self.results: list[dict] = []
        self.n = 0

    def case_dir(self) -> Path:
        self.n += 1
        d = self.work / f"c{self.n:03d}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def cli(self, group: str, name: str, argv: list, stdin: bytes = b"", inputs: tuple = (), expect: str = "",
            env: dict | None = None, after=None) -> dict:
        """``rakv`` in this process: exit code, error lines, traceback (an exception out of main, or
        one printed), hang (past HANG_S), and any input file changed."""
        from rakv.cli import main

        before = {str(p): _digest(p) for p in inputs}
        out, err = io.StringIO(), io.StringIO()
        old_env = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        old_stdin = sys.stdin
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(HANG_S)
        t0 = time.perf_counter()
        code, tb, hang = None, "", False
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([str(a) for a in argv])
        except Hang:
            hang = True
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - what the run looks for
            tb = traceback.format_exc(limit=3)
        finally:
            signal.alarm(0)
            sys.stdin = old_stdin
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        extra = after() if after else {}
        return self.add(group, name, code, err.getvalue(), tb, hang, before, time.perf_counter() - t0, expect, extra)

    def proc(self, group: str, name: str, cmd: list, env: dict | None = None, inputs: tuple = (),
             expect: str = "", timeout: int = HANG_S, after=None) -> dict:
        before = {str(p): _digest(p) for p in inputs}
        t0 = time.perf_counter()
        e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        try:
            r = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout, cwd=self.work)
            code, err, hang = r.returncode, r.stderr, False
        except subprocess.TimeoutExpired as x:
            code, err, hang = None, (x.stderr or b"").decode(errors="replace") if isinstance(x.stderr, bytes) else (x.stderr or ""), True
        extra = after() if after else {}
        return self.add(group, name, code, err, "", hang, before, time.perf_counter() - t0, expect, extra)

    def add(self, group, name, code, err, tb, hang, before, secs, expect, extra) -> dict:
        errors = [x for x in err.splitlines() if ": error" in x
                  or (group == "explorer" and x.startswith("rakv-explorer: Cannot"))]
        changed = [p for p, h in before.items() if _digest(Path(p)) != h]
        traced = bool(tb) or "Traceback (most recent call last)" in err
        if hang:
            outcome = "hang"
        elif traced:
            outcome = "traceback"
        elif changed:
            outcome = "input changed"
        elif code == 0:
            outcome = "ran"
        elif code == 2 and len(errors) == 1:
            outcome = "refused, one line"
        elif code == 1 and group == "explorer" and errors:
            outcome = "dialog"
        else:
            outcome = f"other (exit {code}, {len(errors)} error lines)"
        ok = outcome in ("ran", "refused, one line", "dialog") and not extra.get("problem")
        if expect and ok and expect not in err + json.dumps(extra):
            ok, outcome = False, outcome + f" (without {expect!r})"
        row = {"n": len(self.results) + 1, "group": group, "case": name, "exit": code, "outcome": outcome, "ok": ok,
               "line": errors[0][:200] if errors else "", "seconds": round(secs, 2), **extra}
        if tb:
            row["traceback"] = tb[-600:]
        self.results.append(row)
        mark = "ok " if ok else "BAD"
        print(f"{mark} {row['n']:3d} {group:<11} {name[:60]:<60} {outcome}", file=sys.__stderr__, flush=True)
        return row


def _digest(p: Path) -> str | None:
    try:
        return hashlib.sha256(Path(p).read_bytes()).hexdigest() if Path(p).is_file() else None
    except OSError:
        return None


# ----------------------------------------------------------------------------- the cases
PROMPT_TEXTS = [
    ("invalid byte 0xff", "ab\udcffcd"), ("invalid byte 0x80 alone", "\udc80"), ("truncated 2-byte seq", "caf\udcc3"),
    ("overlong '/' (C0 AF)", "a\udcc0\udcafb"), ("CESU surrogate bytes (ED A0 80)", "x\udced\udca0\udc80"),
    ("lone high surrogate", "a\ud800b"), ("lone low surrogate", "a\udfffb"), ("reversed pair", "\udc00\ud800"),
    ("invalid byte at the end", "hello\udcfe"), ("0xF5 lead byte", "\udcf5\udc80\udc80\udc80"),
    ("only spaces", "   "), ("only newlines", "\n\n"), ("empty", ""), ("NUL inside", "a\x00b"),
    ("control characters", "\x01\x02\x1b[31mred"), ("BOM in front", "\ufeffhello"), ("RTL override", "abc\u202edef"),
    ("emoji and CJK", "🙂 日本語 naïve"), ("combining marks", "e\u0301\u0301\u0301"), ("U+FFFF noncharacter", "x\uffffy"),
    ("private use", "\ue000\U000f0000"), ("U+FFFD itself", "\ufffd\ufffd"), ("a 20,000-char prompt", "word " * 4000),
    ("tabs and CR", "a\tb\rc"), ("line separator U+2028", "a\u2028b"), ("a template marker", "<eos><pad>assistant:"),
    ("JSON-looking text", '{"prompt": "x"}'), ("a shell-looking text", "$(rm -rf /) `x`"), ("dash-leading", "-x"),
    ("flag-looking", "--json"),
]


def prompt_cases(r: Runner, M: Path) -> None:
    base = ["generate", "--target", M / "target", "--draft", "ngram", "--policy", "ar", "--max-new-tokens", "2"]
    for i, (name, text) in enumerate(PROMPT_TEXTS):
        r.cli("argv", f"--prompt: {name}", base + [f"--prompt={text}"], expect="not valid text" if i < 10 else "")


def prompts_file_cases(r: Runner, M: Path) -> None:
    base = ["generate", "--target", M / "target", "--draft", "ngram", "--policy", "ar", "--max-new-tokens", "2"]
    J = lambda *objs: "\n".join(json.dumps(o) for o in objs).encode()  # noqa: E731
    files = [
        ("jsonl: invalid byte in line 2", ".jsonl", J({"prompt": "a"}) + b"\n" + b'{"prompt": "b\xffc"}'),
        ("jsonl: escaped lone surrogate", ".jsonl", b'{"prompt": "a\\ud800"}'),
        ("jsonl: escaped low surrogate", ".jsonl", b'{"prompt": "\\udfff"}'),
        ("jsonl: escaped valid pair", ".jsonl", b'{"prompt": "\\ud83d\\ude42 smile"}'),
        ("jsonl: depth 100000", ".jsonl", b'{"prompt": ' + DEEP.encode() + b"}"),
        ("jsonl: depth 1000", ".jsonl", b"[" * 1000 + b"]" * 1000),
        ("jsonl: depth 65 in an extra key", ".jsonl", b'{"prompt": "a", "x": ' + b"[" * 65 + b"]" * 65 + b"}"),
        ("jsonl: depth 10 in an extra key", ".jsonl", b'{"prompt": "a", "x": ' + b"[" * 10 + b"]" * 10 + b"}"),
        ("jsonl: a list line", ".jsonl", b'["a", "b"]'), ("jsonl: a string line", ".jsonl", b'"just text"'),
        ("jsonl: a number line", ".jsonl", b"42"), ("jsonl: null", ".jsonl", b"null"),
        ("jsonl: prompt is a number", ".jsonl", b'{"prompt": 3}'), ("jsonl: prompt is a list", ".jsonl", b'{"prompt": ["a"]}'),
        ("jsonl: prompt null", ".jsonl", b'{"prompt": null}'), ("jsonl: no prompt key", ".jsonl", b'{"text": "a"}'),
        ("jsonl: empty prompt", ".jsonl", b'{"prompt": ""}'), ("jsonl: NaN value", ".jsonl", b'{"prompt": "a", "x": NaN}'),
        ("jsonl: truncated object", ".jsonl", b'{"prompt": "a'), ("jsonl: trailing comma", ".jsonl", b'{"prompt": "a",}'),
        ("jsonl: two objects on a line", ".jsonl", b'{"prompt": "a"}{"prompt": "b"}'),
        ("jsonl: BOM + CRLF", ".jsonl", b"\xef\xbb\xbf" + J({"prompt": "a"}) + b"\r\n" + J({"prompt": "b"}) + b"\r\n"),
        ("jsonl: UTF-16 file", ".jsonl", '{"prompt": "a"}'.encode("utf-16")),
        ("jsonl: binary garbage", ".jsonl", bytes(range(256))), ("jsonl: empty file", ".jsonl", b""),
        ("jsonl: blank lines only", ".jsonl", b"\n  \n\t\n"), ("jsonl: duplicate keys", ".jsonl", b'{"prompt": "a", "prompt": 5}'),
        ("jsonl: huge number", ".jsonl", b'{"prompt": "a", "n": 1' + b"0" * 5000 + b"}"),
        ("txt: invalid byte line 3", ".txt", b"a\nb\nc\xfe\n"), ("txt: truncated UTF-8 at EOF", ".txt", b"hello \xe6\x97"),
        ("txt: CESU surrogate bytes", ".txt", b"x\xed\xa0\x80y\n"), ("txt: overlong encoding", ".txt", b"\xc0\xaf\n"),
        ("txt: NUL bytes", ".txt", b"a\x00b\n"), ("txt: only blank lines", ".txt", b"\n\n \n"),
        ("txt: BOM only", ".txt", b"\xef\xbb\xbf"), ("txt: CR line ends", ".txt", b"a\rb\r"),
        ("txt: valid two prompts", ".txt", b"alpha beta\ngamma delta\n"),
    ]
    for name, suffix, data in files:
        d = r.case_dir()
        f = d / f"prompts{suffix}"
        f.write_bytes(data)
        r.cli("prompts", name, base + ["--prompts-file", f], inputs=(f,))
    d = r.case_dir()
    r.cli("prompts", "prompts file is a directory", base + ["--prompts-file", d])
    r.cli("prompts", "prompts file does not exist", base + ["--prompts-file", d / "none.jsonl"])
    f = d / "p.jsonl"
    f.write_text('{"prompt": "a"}\n')
    r.cli("prompts", "--record onto the prompts file", base + ["--prompts-file", f, "--record", f], inputs=(f,))


def chat_cases(r: Runner, M: Path) -> None:
    base = ["chat", "--target", M / "target", "--draft", "ngram", "--policy", "ar", "--max-new-tokens", "2", "--json"]
    inputs = [
        ("invalid byte on line 1", b"\xff\n"), ("invalid byte on line 2", b"hello\nbad \xfe\n"),
        ("invalid byte on line 3 after a command", b"/stats\nhi\n\xc3\x28\n"), ("CESU surrogate bytes", b"a\xed\xa0\x80\n"),
        ("overlong encoding", b"\xc0\xaf\n"), ("truncated at EOF", b"hi\n\xe6\x97"), ("empty stdin", b""),
        ("only commands", b"/stats\n/reset\n/help\n"), ("/exit first", b"/exit\nnever\n"), ("blank lines", b"\n\n  \n"),
        ("NUL in a line", b"a\x00b\n"), ("CR only line ends", b"a\rb\r"), ("BOM at the start", b"\xef\xbb\xbfhello\n"),
        ("a 30,000-byte line", b"word " * 6000 + b"\n"), ("binary garbage", bytes(range(256))),
        ("valid two turns", b"alpha\nbeta gamma\n"), ("escape sequences", b"\x1b[2J\x1b]0;title\x07\n"),
        ("latin-1 text", "café".encode("latin-1") + b"\n"), ("UTF-16 text", "hi\n".encode("utf-16")),
        ("unknown command", b"/bogus\n"),
    ]
    for name, data in inputs:
        r.cli("chat stdin", name, base, stdin=data)


def replay_cases(r: Runner, M: Path) -> None:
    src = ROOT / "resources" / "example.jsonl"
    oracle = ROOT / "docs" / "oracle-example.jsonl"
    data = src.read_bytes()
    nl = [i for i, b in enumerate(data) if b == 10]
    cuts = [0, 1, 10, nl[0], nl[0] + 1, nl[0] + 7] + [nl[k] - 3 for k in (1, 5, 20, 50, 100, 150, 200, 223)] + \
           [nl[k] + 2 for k in (2, 30, 99, 222)] + [len(data) - 1]
    for c in cuts:
        d = r.case_dir()
        f = d / "cut.jsonl"
        f.write_bytes(data[:c])
        r.cli("replay", f"recording cut at byte {c}", ["replay", f, "--csv", d / "o.csv"], inputs=(f,))
    extra = json.dumps({"type": "request_start", "request_id": 9, "prompt": "日本語"}, ensure_ascii=False).encode()
    for k in (1, 2):
        d = r.case_dir()
        f = d / "cut.jsonl"
        f.write_bytes(data + extra[: extra.index("本".encode()) + k])
        r.cli("replay", f"cut inside a 3-byte character (+{k})", ["replay", f, "--csv", d / "o.csv"], inputs=(f,))
    lines = oracle.read_text().splitlines()
    oi = next(i for i, x in enumerate(lines) if json.loads(x)["type"] == "oracle")

    def oracle_variant(name, change):
        d = r.case_dir()
        rec = json.loads(lines[oi])
        change(rec)
        f = d / "o.jsonl"
        f.write_text("\n".join(lines[:oi] + [json.dumps(rec)] + lines[oi + 1:]) + "\n")
        r.cli("replay", f"oracle: {name}", ["replay", f, "--csv", d / "o.csv"], inputs=(f,))

    oracle_variant("an empty action", lambda d: d["actions"].__setitem__(0, {}))
    oracle_variant("actions without median_ms", lambda d: [a.pop("median_ms") for a in d["actions"]])
    oracle_variant("actions without min_ms", lambda d: [a.pop("min_ms") for a in d["actions"]])
    oracle_variant("an action that is a string", lambda d: d["actions"].__setitem__(0, "r0k2"))
    oracle_variant("an action that is null", lambda d: d["actions"].__setitem__(0, None))
    oracle_variant("actions is an object", lambda d: d.__setitem__("actions", {"a": 1}))
    oracle_variant("median_ms a string", lambda d: d["actions"][0].__setitem__("median_ms", "fast"))
    oracle_variant("median_ms null", lambda d: d["actions"][0].__setitem__("median_ms", None))
    oracle_variant("runs_ms of strings", lambda d: d["actions"][0].__setitem__("runs_ms", ["1"]))
    oracle_variant("choice a list", lambda d: d.__setitem__("choice", [0, 1]))
    oracle_variant("oracle empty", lambda d: d.__setitem__("oracle", {}))
    oracle_variant("regret a string", lambda d: d.__setitem__("regret", "big"))
    oracle_variant("deep nesting in mismatch", lambda d: d.__setitem__("mismatch", json.loads("[" * 500 + "]" * 500)))
    ex = src.read_text().splitlines()

    def record_variant(name, i, change, raw=None):
        d = r.case_dir()
        if raw is None:
            rec = json.loads(ex[i])
            change(rec)
            raw = json.dumps(rec)
        f = d / "r.jsonl"
        f.write_text("\n".join(ex[:i] + [raw] + ex[i + 1:]) + "\n")
        r.cli("replay", name, ["replay", f, "--csv", d / "o.csv"], inputs=(f,))

    types = {json.loads(x)["type"]: i for i, x in reversed(list(enumerate(ex)))}
    for typ, i in sorted(types.items()):
        rec = json.loads(ex[i])
        for field in [k for k in rec if k != "type"][:4]:
            record_variant(f"{typ}.{field} = a string", i, lambda d, f=field: d.__setitem__(f, "zzz"))
    record_variant("candidates entry without predicted_ms", types["decision"],
                   lambda d: d["candidates"][0].pop("predicted_ms"))
    record_variant("candidates entry a number", types["decision"], lambda d: d["candidates"].__setitem__(0, 5))
    record_variant("unknown record type", 3, lambda d: d.__setitem__("type", "bogus"))
    record_variant("a record that is a list", 3, None, raw="[1, 2]")
    record_variant("a line nested 100000 deep", 3, None, raw=DEEP)
    record_variant("t is NaN", 3, lambda d: d.__setitem__("t", float("nan")))
    record_variant("header schema from the future", 0, lambda d: d.__setitem__("schema", 999))
    record_variant("no header", 0, None, raw=ex[1])
    d = r.case_dir()
    r.cli("replay", "recording is a directory", ["replay", d, "--csv", d / "o.csv"])
    r.cli("replay", "recording does not exist", ["replay", d / "none.jsonl", "--csv", d / "o.csv"])
    f = d / "bin.jsonl"
    f.write_bytes(bytes(range(256)) * 4)
    r.cli("replay", "binary garbage", ["replay", f, "--csv", d / "o.csv"], inputs=(f,))
    f = d / "u16.jsonl"
    f.write_bytes(src.read_text().encode("utf-16"))
    r.cli("replay", "UTF-16 recording", ["replay", f, "--csv", d / "o.csv"], inputs=(f,))
    f = d / "ok.jsonl"
    shutil.copy(src, f)
    r.cli("replay", "--csv onto the recording", ["replay", f, "--csv", f], inputs=(f,))


def profile_cases(r: Runner, M: Path) -> None:
    """Each damage written into the saved profile of an adaptive run; that run and the next must work."""
    cache = r.work / "profile-cache"
    env = {"RAKV_CACHE": str(cache)}
    args = ["generate", "--target", M / "target", "--draft", M / "draft", "--prompt", "alpha beta",
            "--max-new-tokens", "3", "--k-set", "0,1,2"]
    r.cli("profile", "first run (calibrates)", args, env=env)
    (path,) = (cache / "profiles").glob("*.json")
    good = json.loads(path.read_text())
    damages = [
        ("accept_map of strings", {"accept_map": {"hits": ["3"] * 10, "n": ["4"] * 10}}),
        ("accept_map a list", {"accept_map": [1, 2]}), ("accept_map short lists", {"accept_map": {"hits": [1], "n": [0]}}),
        ("accept_map negative", {"accept_map": {"hits": [-1] * 10, "n": [1] * 10}}),
        ("alpha_by_setting strings", {"alpha_by_setting": {"t0.7": {"alpha0": "x"}}}),
        ("alpha_by_setting a list", {"alpha_by_setting": [1]}), ("quality a string", {"quality": "clean"}),
        ("quality.spread strings", {"quality": {"spread": {"t": "x"}}}), ("regime a list", {"regime": []}),
        ("regime.floor_ms a string", {"regime": {"floor_ms": "1"}}), ("V of strings", {"V": {"1": "2"}}),
        ("V empty", {"V": {}}), ("t empty", {"t": []}), ("T_pf of triples", {"T_pf": [[1, 2, 3]]}),
        ("alpha0 = 7", {"alpha0": 7}), ("alpha_learned a string", {"alpha_learned": "0.5"}),
        ("scale negative", {"scale": {"machine": -1}}), ("samples floats", {"samples": {"t": 1.5}}),
        ("fingerprint a list", {"fingerprint": []}), ("unknown field", {"bogus": 1}),
        ("deep nesting in regime", {"regime": json.loads("[" * 200 + "]" * 200)}),
    ]
    for name, change in damages:
        path.write_text(json.dumps({**good, **change}))
        valid = name in ("accept_map short lists", "V empty")    # a shorter prior is ignored; no V: measured again
        r.cli("profile", f"{name}: this run", args, env=env, expect="" if valid else "cost profile")
        r.cli("profile", f"{name}: the next run", args, env=env)
    for name, raw in (("truncated JSON", path.read_text()[:50]), ("a 100000-deep array", DEEP),
                      ("binary", "\x00\xff"), ("a JSON string", '"profile"')):
        path.write_bytes(raw.encode("latin-1"))
        r.cli("profile", f"{name}: this run", args, env=env, expect="cost profile")
        r.cli("profile", f"{name}: the next run", args, env=env)


def kernels_json_cases(r: Runner, M: Path) -> None:
    """kernels.json as read by the one-row kernel choice (made to run on the tiny model)."""
    from rakv.kernels import fastpath

    cache = r.work / "kj-cache"
    env = {"RAKV_CACHE": str(cache), "RAKV_ONE_ROW": "auto"}
    args = ["generate", "--target", M / "target", "--draft", "ngram", "--policy", "ar", "--prompt", "alpha",
            "--max-new-tokens", "2"]
    old = fastpath.ONE_ROW_MIN_PARAMS
    fastpath.ONE_ROW_MIN_PARAMS = 0
    try:
        for name, raw in (("a list", '["plain"]'), ("a string", '"packed"'), ("a number", "3"), ("null", "null"),
                          ("100000 deep", DEEP), ("binary", "\xff\xfe"), ("truncated", '{"a": '),
                          ("entry a number", '{"x": 3}'), ("kernel a number", None), ("empty", "")):
            cache.mkdir(parents=True, exist_ok=True)
            kj = cache / "kernels.json"
            if raw is None:
                kj.write_text("{}")
                r.cli("kernels.json", "(fill it first)", args, env=env)
                d = json.loads(kj.read_text())
                raw = json.dumps({k: {**v, "kernel": 5} for k, v in d.items()} if isinstance(d, dict) else {})
            kj.write_bytes(raw.encode("latin-1"))
            shape = name not in ("entry a number", "kernel a number")     # those are objects: entries re-measured
            r.cli("kernels.json", f"kernels.json {name}", args, env=env, expect="is damaged" if shape else "")
            r.cli("kernels.json", f"kernels.json {name}: the next run", args, env=env)
    finally:
        fastpath.ONE_ROW_MIN_PARAMS = old


FLAG_CASES = [
    ["--max-new-tokens", "0"], ["--max-new-tokens", "-5"], ["--max-new-tokens", "1e3"], ["--max-new-tokens", "99999999999999999999"],
    ["--budget-mib", "nan"], ["--budget-mib", "-1"], ["--budget-mib", "inf"], ["--k-set", ""], ["--k-set", "1,,2"],
    ["--k-set", "-1"], ["--k-set", "0,1,999"], ["--policy", "spec:0"], ["--policy", "joint:-1"], ["--policy", "tree:0"],
    ["--policy", "bogus"], ["--policy", "spec:2", "--draft", "none"], ["--temperature", "nan"], ["--temperature", "-1"],
    ["--top-p", "2"], ["--top-k", "-3"], ["--min-p", "1.5"], ["--seed", "x"], ["--verify", "maybe"], ["--threads", "0"],
    ["--threads", "100000"], ["--device", "cuda:9"], ["--device", "tpu"], ["--dtype", "float7"], ["--explore-share", "2"],
    ["--granularity", "token"], ["--record", "/nonexistent/dir/r.jsonl"], ["--target", ""], ["--target", "/nonexistent"],
    ["--draft", "/nonexistent"], ["--draft", "layers:-1"],
]


def flag_cases(r: Runner, M: Path) -> None:
    base = ["generate", "--target", M / "target", "--draft", "ngram", "--policy", "ar", "--prompt", "alpha",
            "--max-new-tokens", "2"]
    for extra in FLAG_CASES:
        r.cli("flags", "generate " + " ".join(extra), base + extra)
    for argv in (["calibrate", "--k-max", "0"], ["calibrate", "--k-max", "nan"], ["replay"], ["bogus"], [],
                 ["replay", "x.jsonl"], ["bench", "--repeats", "0"], ["bench", "--workload", "/nonexistent"],
                 ["chat", "--prompt", "x"], ["generate"]):
        r.cli("flags", " ".join(argv) or "(no arguments)", argv)


def trust_cases(r: Runner, M: Path) -> None:
    """Planted native code and pickles, each in its own process."""
    code = r"""
import os, sys, pickle, subprocess
from pathlib import Path
from rakv.kernels import blockq, trust
from rakv.load import tokenizer as models
case = sys.argv[1]
mark = Path(os.environ["MARK"])
if case.startswith("kernel"):
    cc = blockq._compiler()
    out = blockq._build_dir() / f"blockq-{blockq._ident(cc)}.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent.parent / "plant.c"
    src.write_text('#include <stdio.h>\n#include <stdlib.h>\n__attribute__((constructor)) static void p(void)'
                   '{FILE*f=fopen(getenv("MARK"),"w"); if(f){fputs("ran",f);fclose(f);}}\nint rakv_linear(void){return 0;}\n')
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    if case == "kernel, open folder":
        os.chmod(out.parent, 0o777)
    if case == "kernel, forged record":
        trust.record(out)
        os.chmod(out.parent, 0o777)
    if case == "kernel, symlink":
        real = out.parent.parent / "elsewhere.so"
        os.replace(out, real)
        out.symlink_to(real)
    lib = blockq.library()
    print("loaded" if lib is not None else "not built: " + blockq.reason(), file=sys.stderr)
else:
    folder = trust.private_dir(Path(os.environ["RAKV_CACHE"]) / "folder")
    from tests.tiny import tiny_tokenizer
    tiny_tokenizer().save_pretrained(folder)
    class P:
        def __reduce__(self):
            return (open, (str(mark), "w"))
    with open(folder / models.TOKENIZER_CACHE, "wb") as f:
        pickle.dump(P(), f)
    if case == "pickle, forged record, open folder":
        trust.record(folder / models.TOKENIZER_CACHE)
        os.chmod(folder, 0o777)
    models.load_tokenizer(folder)
print("planted code ran" if mark.exists() else "planted code never ran", file=sys.stderr)
sys.exit(1 if mark.exists() else 0)
"""
    for case in ("kernel", "kernel, open folder", "kernel, forged record", "kernel, symlink", "pickle",
                 "pickle, forged record, open folder"):
        d = r.case_dir()
        r.proc("trust", f"planted {case}", [sys.executable, "-c", code, case],
               env={"RAKV_CACHE": str(d / "cache"), "MARK": str(d / "ran")}, expect="never ran", timeout=300)


def gguf_cases(r: Runner, M: Path) -> None:
    """A conversion into a disk that fills up (a file-size limit: the write fails with EFBIG as on
    ENOSPC), then the next run, which must convert again and say why."""
    try:
        from tests.unit.test_gguf import _tiny_gguf
    except Exception as e:  # noqa: BLE001
        print(f"skipping the GGUF cases: {e}", file=sys.stderr)
        return
    d = r.case_dir()
    f, _ = _tiny_gguf(d / "src")
    limited = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               "lim = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (lim, lim))\n"
               "from rakv.cli import main\nsys.exit(main(sys.argv[2:]))\n")
    args = ["generate", "--target", str(f), "--draft", "ngram", "--policy", "ar", "--prompt", "alpha", "--max-new-tokens", "2"]
    for limit in (1000, 20_000, 300_000):
        cache = d / f"cache-{limit}"

        def leftover(cache=cache):
            m = cache / "models"
            dirs = [p.name for p in m.iterdir() if p.is_dir()] if m.is_dir() else []
            return {"folders_left": dirs, "problem": bool(dirs)}
        r.proc("full disk", f"conversion with files limited to {limit} bytes",
               [sys.executable, "-c", limited, str(limit), *args], env={"RAKV_CACHE": str(cache)}, inputs=(f,),
               after=leftover)
        r.proc("full disk", f"the next run after the {limit}-byte limit", [sys.executable, "-m", "rakv", *args],
               env={"RAKV_CACHE": str(cache)}, inputs=(f,), expect="converting it again")


def explorer_cases(r: Runner, M: Path) -> None:
    src = ROOT / "resources" / "example.jsonl"
    data = src.read_bytes()
    cases = [("cut mid-record", data[: data.index(b"\n", len(data) // 2) + 30]),
             ("cut inside a character", data + '{"type":"request_start","prompt":"日'.encode()[:-1]),
             ("header only, cut", data[: data.index(b"\n") + 12]), ("cut inside the header", data[:40]),
             ("empty file", b"")]
    for name, blob in cases:
        d = r.case_dir()
        f = d / "cut.jsonl"
        f.write_bytes(blob)
        r.proc("explorer", f"--replay: {name}", [sys.executable, "-m", "app", "--replay", str(f), "--exit-after-run"],
               env={"QT_QPA_PLATFORM": "offscreen", "RAKV_SETTINGS": str(d / "s.ini")}, inputs=(f,))


GROUPS = {"argv": prompt_cases, "prompts": prompts_file_cases, "chat": chat_cases, "replay": replay_cases,
          "profile": profile_cases, "kernels": kernels_json_cases, "flags": flag_cases, "trust": trust_cases,
          "gguf": gguf_cases, "explorer": explorer_cases}


def summary(results: list[dict]) -> str:
    groups: dict[str, dict] = {}
    for row in results:
        g = groups.setdefault(row["group"], {})
        g[row["outcome"]] = g.get(row["outcome"], 0) + 1
    bad = [x for x in results if not x["ok"]]
    out = [f"{len(results)} cases, {len(results) - len(bad)} as they should be (ran, or refused with one line and "
           f"exit 2, or a dialog), {len(bad)} not.", "", "| group | cases | outcomes |", "|---|---|---|"]
    for g, counts in groups.items():
        out.append(f"| {g} | {sum(counts.values())} | " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + " |")
    out += ["", "| # | group | case | exit | outcome |", "|---|---|---|---|---|"]
    for x in results:
        out.append(f"| {x['n']} | {x['group']} | {x['case'].replace('|', '/')} | {x['exit']} | {x['outcome']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="hostile-run")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated: " + ", ".join(GROUPS))
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out / "work", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAKV_CONTENTION_CHECK", "0")
    os.environ["RAKV_CACHE"] = str(out / "work" / "cache")
    from rakv.common import quiet_libs
    from tests.tiny import save_tiny

    quiet_libs()
    import torch

    torch.set_num_threads(1)
    M = out / "work" / "models"
    t = save_tiny(M / "target", "llama")
    save_tiny(M / "draft", draft_of=t)
    r = Runner(out)
    t0 = time.time()
    for g in args.groups.split(","):
        GROUPS[g](r, M)
    (out / "cases.jsonl").write_text("".join(json.dumps(x) + "\n" for x in r.results))
    (out / "summary.md").write_text(summary(r.results))
    bad = sum(not x["ok"] for x in r.results)
    print(f"{len(r.results)} cases in {time.time() - t0:.0f} s; {bad} not as they should be; {out / 'summary.md'}",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
