"""The bench's peer interface: a baseline that is not the rakv engine, run on the same workload.

A peer adds its flags (``add_args``), checks them before any model loads (``check`` first of all,
``configure`` with the other settings), names the arms it adds (``arm_names`` for ``--policies``,
``default_arms`` for the default set, ``added_arms`` for arms its own flags ask for), says why an
arm cannot run (``why_not``), and runs one arm on one request of the stream (``run``: the columns
of its executions.csv row). A peer that runs its own arms on its own engine instead of the bench's
loop (``--peer vllm``) says so with ``takes_over`` and runs in ``run_alone``.

A new peer: copy rakv/bench/peers/llamacpp.py's ``LlamaCppPeer`` (the smallest) into a file of this
package and add one line to ``PEERS`` in rakv/bench/peers/__init__.py.
"""

from __future__ import annotations


class Peer:
    name: str = ""                       # what it is, in messages
    arm_names: tuple[str, ...] = ()      # the arms --policies may name
    own_process: bool = False            # runs in another process: this thread's CPU share says nothing
    compare: str = "ids"                 # "ids": held to ar's tokens (runner.token_exact); "text": its text
                                         # against ar's (another program's arithmetic: match -1, text_match)

    def add_args(self, ap) -> None:
        """Its flags on ``rakv bench``'s parser."""

    def check(self, args) -> None:
        """Flags checked before anything else runs (ValueError: one line)."""

    def configure(self, args, policies: list[str] | None) -> None:
        """Its settings from the flags, checked before any model loads (ValueError: one line);
        ``policies``: the names --policies gave (None: the default set)."""

    def takes_over(self, args) -> bool:
        """Does it run instead of the engine's policies (its own arms on its own engine)?"""
        return False

    def run_alone(self, args) -> int:
        raise NotImplementedError

    def owns(self, arm: str) -> bool:
        return arm in self.arm_names

    def why_not(self, arm: str, draft) -> str | None:
        """Why ``arm`` cannot run with this draft here (None: it can)."""
        return None

    def default_arms(self, draft) -> list[str]:
        """Its arms in the default set (rakv bench without --policies, with --peers)."""
        return []

    def added_arms(self, args, draft) -> list[str]:
        """Arms its own flags ask for, added to any set."""
        return []

    def run(self, arm: str, req, ctx) -> dict:
        """One execution of ``arm`` on ``req`` (a rakv.workloads.Request) in the bench's context
        (runner.BenchContext): its row's columns, with ``_ids`` the output ids (and ``_text`` the
        output text for a text-compared peer)."""
        raise NotImplementedError

    def meta(self, args) -> dict:
        """What it adds to meta.json."""
        return {}


def ids_row(output_ids: list[int], latency_ms: float, ttft_ms: float, gen: int) -> dict:
    """The executions row of a peer that gives ids and times only (no drafting counts, no reuse)."""
    n = len(output_ids)
    return dict(latency_ms=round(latency_ms, 3), ttft_ms=round(ttft_ms, 3),
                tokens_per_s=round(n / (latency_ms / 1e3), 3) if latency_ms else 0.0, output_tokens=n,
                drafted="", accepted="", rounds="", mean_accept_len="", alpha_req="", hit_tokens=0,
                exact_repeat=0, reuse=0, k="", mean_k="", predicted_ms="",
                stopped="eos" if n < gen else "max_new_tokens", _ids=output_ids)
