"""RAKV Explorer engine: exact greedy speculative decoding with cross-request prefix KV reuse.

Qt-free. The GUI lives in ``app/`` and only consumes the plain-Python records emitted here.
"""

__version__ = "0.1.0"
