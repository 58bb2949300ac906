"""Property-based tests (hypothesis) over what reads outside input: the prompts-file reader, the
recording reader, the cost-profile loader and the CLI's argument parser. Each input gives a valid
result or one clear line (exit 2 for the CLI), never another exception. Bounded: few examples, no
deadline per example, no example database; the whole file runs in well under a minute on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rakv.decide import profile as CP  # noqa: E402
from rakv.cli import main  # noqa: E402
from rakv.common import CliError, read_prompts  # noqa: E402
from rakv.records import Recording, RecordingError, read_recording, write_csv  # noqa: E402
from rakv.util.text_in import text_problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_LINES = (ROOT / "resources" / "example.jsonl").read_bytes().splitlines(keepends=True)[:12]
BOUNDED = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck))

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


def one_line(msg: str) -> bool:
    return bool(msg.strip()) and "\n" not in msg.strip()


# ----------------------------------------------------------------------------- the prompts file
prompt_bytes = st.one_of(
    st.binary(max_size=200),
    st.lists(json_values.map(lambda v: json.dumps(v).encode()), max_size=5).map(b"\n".join),
    st.lists(st.text(max_size=20).map(lambda t: json.dumps({"prompt": t}).encode()), max_size=5).map(b"\n".join),
    st.integers(1, 3000).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}"),
)


@BOUNDED
@given(data=prompt_bytes, suffix=st.sampled_from([".jsonl", ".txt"]))
def test_prompts_file_reader(tmp_path_factory, data, suffix):
    f = tmp_path_factory.mktemp("pf") / f"p{suffix}"
    f.write_bytes(data)
    try:
        prompts = read_prompts(str(f))
    except CliError as e:
        assert one_line(str(e)) and f.name in str(e)
        return
    assert prompts and all(isinstance(p, str) and text_problem(p) is None for p in prompts)   # empty: generate refuses


# ----------------------------------------------------------------------------- recordings
def mutate(lines: list[bytes], how: int, at: int, blob: bytes) -> bytes:
    i = at % len(lines)
    out = list(lines)
    if how == 0:                                   # cut anywhere (a kill -9)
        return b"".join(out)[: at % (sum(map(len, out)) + 1)]
    if how == 1:                                   # a line replaced by other bytes
        out[i] = blob + b"\n"
    elif how == 2:                                 # bytes inserted into a line
        j = at % max(1, len(out[i]))
        out[i] = out[i][:j] + blob + out[i][j:]
    elif how == 3:                                 # a line dropped
        del out[i]
    return b"".join(out)


@BOUNDED
@given(how=st.integers(0, 3), at=st.integers(0, 10**6), blob=st.binary(max_size=12) | json_values.map(
    lambda v: json.dumps(v).encode()))
def test_recording_reader(tmp_path_factory, how, at, blob):
    d = tmp_path_factory.mktemp("rec")
    f = d / "r.jsonl"
    f.write_bytes(mutate(EXAMPLE_LINES, how, at, blob))
    try:
        recs = read_recording(f)
    except RecordingError as e:
        assert one_line(str(e)) and "r.jsonl" in str(e)
        return
    assert isinstance(recs, Recording) and len(recs) >= 1
    write_csv(recs, d / "r.csv")                   # what replay derives from it works too


@BOUNDED
@given(field=st.sampled_from(["actions", "choice", "oracle", "candidates", "action"]), value=json_values)
def test_recording_nested_fields(tmp_path_factory, field, value):
    """Any JSON in the nested fields the explorer reads: refused with file:line, or replayable."""
    from rakv.records import write_oracle_csv

    oracle = (ROOT / "docs" / "oracle-example.jsonl").read_text().splitlines()
    i = next(n for n, x in enumerate(oracle) if json.loads(x)["type"] == ("oracle" if field in ("actions", "choice", "oracle") else "decision"))
    d = json.loads(oracle[i])
    d[field] = value
    f = tmp_path_factory.mktemp("nest") / "o.jsonl"
    f.write_text("\n".join(oracle[:i] + [json.dumps(d)] + oracle[i + 1:]) + "\n")
    try:
        recs = read_recording(f)
    except RecordingError as e:
        assert one_line(str(e)) and f"o.jsonl:{i + 1}" in str(e)
        return
    write_csv(recs, f.with_suffix(".csv"))
    write_oracle_csv(recs, f.with_suffix(".oracle.csv"))


# ----------------------------------------------------------------------------- cost profiles
GOOD = {"T_pf": [[1, 1.0], [64, 8.0]], "t": [[16, 1.0], [256, 1.5]], "V": {"1": 1.3, "2": 1.6},
        "D_pf": [[1, 0.5]], "d": [[16, 0.4]]}
FIELDS = ["T_pf", "D_pf", "t", "d", "V", "V_ctx", "d2_ratio", "alpha0", "alpha_learned", "out_frac", "alpha_trials",
          "accept_map", "alpha_by_setting", "scale", "samples", "quality", "regime", "fingerprint", "calibrated_at"]


def use(prof) -> None:
    """What the engine, the controller and `rakv calibrate` read of a loaded profile."""
    from rakv.cli import regime_lines
    from rakv.decide.gate import AcceptMap

    for ctx in (1, 100, 5000):
        prof.step(ctx), prof.draft_step(ctx), prof.T(ctx), prof.D(ctx)
        for k in prof.V:
            prof.verify(int(k), ctx)
    AcceptMap(prof.alpha_learned or prof.alpha0, prof.accept_map).p(0.55)
    for v in prof.alpha_by_setting.values():
        float(v.get("alpha_learned") if v.get("alpha_learned") is not None else prof.alpha0)
    regime_lines(prof)
    q = prof.quality
    max(q.get("spread", {0: 0}).values() or [0]), "; ".join(q.get("reasons", []))


@BOUNDED
@given(changes=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3))
def test_profile_loader(tmp_path_factory, changes):
    p = tmp_path_factory.mktemp("prof") / "p.json"
    p.write_text(json.dumps({**GOOD, **changes}))
    try:
        prof = CP.load_profile(p)
    except CP.ProfileError as e:
        assert one_line(str(e)) and "p.json" in str(e)
        return
    use(prof)


@BOUNDED
@given(data=st.binary(max_size=64) | st.integers(1, 5000).map(lambda n: b"[" * n))
def test_profile_loader_bytes(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("prof") / "p.json"
    p.write_bytes(data)
    try:
        CP.load_profile(p)
    except CP.ProfileError as e:
        assert one_line(str(e))


# ----------------------------------------------------------------------------- the CLI's arguments
FLAGS = ["--prompt", "--prompts-file", "--max-new-tokens", "--policy", "--k-set", "--budget-mib", "--granularity",
         "--explore-share", "--record", "--json", "--raw", "--temperature", "--top-k", "--top-p", "--min-p",
         "--seed", "--verify", "--threads", "--device", "--dtype", "--csv", "--oracle-csv", "--quick", "--k-max",
         "--help", "--fast", "--no-fast", "--draft"]
VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "2.5", "nan", "inf", "1e999", "", "adaptive", "spec:0",
                                    "joint:-3", "tree:99999", "0,1,2", "1,,2", "x", "cuda:7", "mps", "none",
                                    "ngram", "seeded", "/", "/nonexistent/dir/f.jsonl", "\udcff", "a\ud800"]),
                   st.text(max_size=10))


@settings(max_examples=80, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cmd=st.sampled_from(["generate", "chat", "calibrate", "replay", "bench", "serve", ""]),
       rest=st.lists(st.sampled_from(FLAGS) | VALUES, max_size=6))
def test_cli_argument_parser(capsys, monkeypatch, tmp_path_factory, cmd, rest):
    """Any argv: exit 0 (--help), or exit 2 with one error line; models never load (the target
    is a path that does not exist, so a command line that parses stops there, with exit 2)."""
    import io
    import sys

    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    argv = ([cmd] if cmd else []) + rest
    if cmd in ("generate", "chat", "calibrate", "bench"):
        argv += ["--target", "/nonexistent/model"]
    try:
        code = main(argv)
    except SystemExit as e:                       # only bench's own parser may exit this way
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        errors = [x for x in err.splitlines() if ": error" in x]
        assert len(errors) == 1, (argv, err)
