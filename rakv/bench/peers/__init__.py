"""The bench's peers, one interface (``base.Peer``), one file each: transformers (hf:assist,
hf:confidence, hf:lookup), llama.cpp (llama-cpp-python's ``llama.cpp`` arm and llama.cpp's own
tools, ``llama.cpp:*``), vLLM (``--peer vllm``), servers under concurrent load (``--load``: rakv serve
and llama-server). A new peer: one file and one line in ``PEERS``.
"""

from __future__ import annotations

from .base import Peer
from .llamacpp import LlamaCppPeer, LlamaCppToolsPeer
from .serving import ServingPeer
from .transformers import TransformersPeer
from .vllm import VllmPeer

# the registry, in the order their flags and default arms appear
PEERS: tuple[Peer, ...] = (TransformersPeer(), LlamaCppPeer(), LlamaCppToolsPeer(), VllmPeer(), ServingPeer())


def peer_of(arm: str) -> Peer | None:
    """The peer an arm name belongs to (None: an engine policy)."""
    return next((p for p in PEERS if p.owns(arm)), None)


def nameable(arm: str) -> bool:
    """May --policies name this arm (a peer's declared arm)?"""
    return any(arm in p.arm_names for p in PEERS)
