"""The machine's regime: what decides whether speculation can pay here.

``regime(profile)`` gathers the CPU's vector ISA (from /proc/cpuinfo flags or lscpu), the torch
threads, the profile's costs at context ``CTX`` (t, d/t, V(k)/t for every measured k) and its
acceptance (alpha0 from calibration, the learned one). From the costs alone it also states the
best case: the decode cost per emitted token of k drafts at alpha = 1, (k*d + V(k)) / ((k+1)*t);
when no k is below 1 there, no acceptance can make speculation pay on this machine. And the
decode-only crossover alpha*(k): the smallest alpha with (k*d + V(k)) / E_k(alpha) <= t (prefill
and catch-up left out, so the controller's alpha* at a given request is at least this).

Used by ``rakv bench`` (meta.json and the summary header) and ``rakv calibrate``. No Qt, no
controller: only a profile's measured terms.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from .policy import drafting_ks, round_crossover, round_draft_ms

CTX = 128            # context at which the regime's ratios are stated (the profile's V_ctx default)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
             "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The vector-ISA flags of interest, in ISA_FLAGS order, from /proc/cpuinfo ('flags' on x86,
    'Features' on ARM) or else ``lscpu``; [] when neither says."""
    text = cpuinfo
    if text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
    have: set[str] = set()
    for line in text.splitlines():
        name, _, val = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            have.update(val.split())
            break
    if not have and cpuinfo is None and shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            if line.lower().startswith("flags:"):
                have.update(line.split(":", 1)[1].split())
    return [f for f in ISA_FLAGS if f in have]


def cpu_capability() -> str | None:
    """torch's own view of the CPU's kernels (e.g. 'AVX2', 'AVX512', 'DEFAULT'), if it says."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError, RuntimeError):
        return None


def threads() -> int | None:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return os.cpu_count()


def decode_crossover(t: float, d: float, v: float, k: int, d2_extra: float = 0.0) -> float | None:
    """Smallest alpha in [0, 1] with (k*d + alpha^k d2_extra + v) / E_k(alpha) <= t (d2_extra: the
    2-token draft step over d); None when even alpha = 1 loses (``policy.round_crossover``)."""
    return round_crossover(k, t, v, d, d2_extra)


def regime(profile, cpuinfo: str | None = None) -> dict:
    """The regime of this machine for ``profile``'s model pair (plain JSON-able values)."""
    t = profile.step(CTX)
    d = profile.draft_step(CTX)
    ks = sorted(int(k) for k in getattr(profile, "V", {}) or {})
    v = {k: profile.verify(k, CTX) for k in ks}
    kd = drafting_ks(ks)
    d2x = profile.draft_terms(CTX)[1] if hasattr(profile, "draft_terms") else 0.0
    # at alpha = 1 every round opens with the 2-token step
    best = {k: (round_draft_ms(k, 1.0, d, d2x) + v[k]) / ((k + 1) * t) for k in kd} if t > 0 else {}
    fp = getattr(profile, "fingerprint", None) or {}
    return dict(
        isa=cpu_flags(cpuinfo), cpu_capability=cpu_capability(), threads=threads(),
        one_row_kernel=fp.get("one_row") or ("plain" if fp.get("fast") else ""),
        block_layers=int(fp.get("blockq") or 0),
        ctx=CTX, t_ms=round(t, 3), d_ms=round(d, 3), d_over_t=round(d / t, 3) if t > 0 else None,
        d2_over_d=round(getattr(profile, "d2_ratio", 1.0), 3) if d > 0 and getattr(profile, "D_pf", None) else None,
        V_over_t={str(k): round(v[k] / t, 3) for k in ks} if t > 0 else {},
        alpha1_cost_per_token={str(k): round(x, 3) for k, x in best.items()},
        can_pay=any(x < 1.0 for x in best.values()),
        alpha_star_decode={str(k): (None if (a := decode_crossover(t, d, v[k], k, d2x)) is None else round(a, 3))
                           for k in kd},
        alpha0=round(profile.alpha0, 3) if profile.alpha0 is not None else None,
        alpha_learned=None if getattr(profile, "alpha_learned", None) is None else round(profile.alpha_learned, 3),
        contended=bool(getattr(profile, "contended", False)),
    )


def describe(reg: dict) -> list[str]:
    """Human-readable lines (the bench summary header and `rakv calibrate`)."""
    isa = " ".join(reg.get("isa") or []) or "not recorded"
    cap = f" (torch kernels: {reg['cpu_capability']})" if reg.get("cpu_capability") else ""
    row = f"; one-row kernel {reg['one_row_kernel']}" if reg.get("one_row_kernel") else ""
    if reg.get("block_layers"):
        row += f"; {reg['block_layers']} linear layers from exact block codes (up to 64 rows)"
    lines = [f"ISA: {isa}{cap}; {reg.get('threads', '?')} threads{row}"]
    if reg.get("t_ms") is not None:
        vt = ", ".join(f"{k}: {x:.2f}" for k, x in (reg.get("V_over_t") or {}).items())
        lines.append(f"t = {reg['t_ms']:.2f} ms (target step at context {reg.get('ctx', CTX)}); "
                     f"d/t = {_f(reg.get('d_over_t'))}"
                     + (f" (2-token draft step {_f(reg['d2_over_d'])} d)" if reg.get("d2_over_d") else "")
                     + f"; V(k)/t = {vt or '-'}")
        best = reg.get("alpha1_cost_per_token") or {}
        if best:
            kb = min(best, key=lambda k: best[k])
            verdict = ("speculation can pay" if reg.get("can_pay") else
                       "no k can pay even at alpha = 1: speculation cannot pay on this machine")
            stars = ", ".join(f"{k}: {_f(a)}" for k, a in (reg.get("alpha_star_decode") or {}).items())
            lines.append(f"best case (alpha = 1) decode cost per token / t: {best[kb]:.2f} at k = {kb} "
                         f"-> {verdict}; decode-only alpha*(k) = {stars}")
    lines.append(f"alpha0 (calibration) = {_f(reg.get('alpha0'))}; learned alpha = {_f(reg.get('alpha_learned'))}"
                 + ("; **the profile was calibrated on a busy machine (contended)**" if reg.get("contended") else ""))
    return lines


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
