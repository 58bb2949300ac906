"""The block kernel's constants (shared by every part of ``rakv.kernels.blockq``)."""

from __future__ import annotations

BLK = 32                 # inputs per block (GGUF's Q4_0/Q4_1/Q8_0)
MAX_ROWS = 64            # rows up to which the block kernel runs: every decode and verify step (k <= 16) and
                         # short prefills (where it beats oneDNN's packed fp32: docs/fastpath.md)
ATTEND_ROWS = 17         # new rows up to which a step's attention is blockq.attend (decode and verify)
MIN_PARAMS = 1024        # smaller weights are not worth a kernel call's overhead
QK_K = 256               # inputs per K-quant super-block (Q2_K .. Q6_K)
TILE = 16                # outputs a tile of the tiled K-quant form (blockq.c)
KIND_CODES = {"q4": 4, "q8": 8, "q8x": 9}     # rakv_layer.kind in blockq.c
NUMERICS = ("fp32", "q8")       # rakv_layer.numerics in blockq.c: 0, 1
