"""Exact block-coded weights: a linear layer whose fp32 weights are exactly GGUF blocks runs from
the blocks.

The demo model comes from a Q4_1 GGUF (its LM head / embedding from Q8_0): every weight of its
linear layers is exactly ``d * q + m`` for a 4-bit code q and a scale d and minimum m shared by 32
inputs (the head's ``d * q`` for an 8-bit q). Stored as fp32 those weights cost 32 bits each, and a
decode step, which streams every weight once, pays for 32. Kept as the codes they cost 4.5 (8.5),
and ``kernels/blockq.c`` rebuilds each weight in fp32 exactly as it was, then multiplies in fp32:
the same weights and the same fp32 maths, about a seventh of the bytes.

Nothing is assumed: ``encode`` finds codes for a weight block by block and keeps them only when
every element is rebuilt bit for bit; a layer where one block fails stays on the fp32 kernels. The kernel's order of additions does not
depend on the number of rows, so a row of a (k + 1)-token verify equals the same row computed as
a decode step, bit for bit.

The kernel is C, compiled once per machine with the system's C compiler (``cc``, ``-O3
-march=native -fopenmp``; a few seconds) into the cache dir and loaded with ctypes; it runs on torch's own
OpenMP runtime and thread count. Where it cannot be built (no compiler, not x86-64 / ARM Linux or
macOS), or ``RAKV_BLOCKQ=0`` (read at load by ``rakv.backends.switches`` and passed down: nothing
here reads the environment), or the weights are not block-coded, the fp32 kernels run as before.
Up to ``MAX_ROWS`` rows (decode, draft and verify steps, short prefills) use it; longer prefills keep
oneDNN's packed fp32 (a compute-bound shape where its blocking wins).

The parts: ``consts`` (block sizes, row limits), ``lib`` (building and loading the C kernel),
``tiles`` (the tiled form of q8 codes), ``weight`` (``BlockWeight``, ``encode``, quantizing),
``gguf`` (codes read from a GGUF's blocks), ``attend`` (attention and a step's layers in one C call),
``store`` (a model's layers on their codes, the cache dir's copies). This package re-exports them.
"""

from __future__ import annotations

from .attend import DecoderLayerDesc, _tree_fn, attend, attend_ok, attend_tree, decode_layers, layer_ref
from .consts import ATTEND_ROWS, BLK, KIND_CODES, MAX_ROWS, MIN_PARAMS, NUMERICS, QK_K, TILE
from .gguf import GGUF_BLOCK, from_gguf
from .lib import SOURCE, _build, _build_dir, _compiler, _ident, _Lib, _load, build_id, library, reason
from .store import (CodedEmbedding, _cache_path, _load_cached, _matrix, _save_cached, attach, attach_tiles,
                    load_codes, save_codes)
from .tiles import TILE_FIELDS, _by_tiles, _read_tiles, _tiles_fit, _write_tiles, tiled, tiles
from .weight import (BlockWeight, _LayerDesc, _solve, concat, encode, narrower_q4, parts_of, quantize_q4_1,
                     quantize_q8_0)


