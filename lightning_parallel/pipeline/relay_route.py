"""Where the hidden state crosses between ranks in one whole forward run by every pipeline rank (pure logic).

A step that generates (``generation``) runs the model's forward once per new token, and every rank
of the pipeline runs each of those forwards from the top (``relay``). Block ``i`` runs on the rank that
owns it; each other rank passes its call through. The hidden state moves only where the owner
changes between consecutive blocks: the rank that ran block ``i - 1`` sends block ``i``'s input (what
the caller computed after block ``i - 1``, as at a stage boundary of ``stage_modules``) to the rank
that owns block ``i``. That rank takes it already at the first call of the run of other ranks' blocks
before its own, so the stand-in just before its block returns it, as in a pipelined step.

Every rank visits the blocks in the same order and each transfer is one send matched by one receive,
so the transfers of a forward are totally ordered and no two ranks wait on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_parallel.pipeline.partition import StagePlan


@dataclass(frozen=True)
class BlockRoute:
    """What one rank does at the call of one block in a relayed forward.

    ``owned``: the rank runs the block. ``send_to``: before anything else, send the block's input to this
    pipeline rank (its owner; this rank ran the block before). ``receive_from``: receive from this
    pipeline rank the input of this rank's next block. ``hands_over``: the next block is this rank's, so
    the stand-in returns the received state.
    """

    owned: bool
    send_to: Optional[int] = None
    receive_from: Optional[int] = None
    hands_over: bool = False


def block_routes(plan: StagePlan, rank: int) -> tuple[BlockRoute, ...]:
    """``BlockRoute`` of every block of ``plan`` for pipeline rank ``rank``."""
    owners = [plan.rank_of_stage(plan.block_owner(i)) for i in range(sum(len(b) for b in plan.stage_blocks))]
    routes = []
    for i, owner in enumerate(owners):
        send_to = owner if i > 0 and owners[i - 1] == rank and owner != rank else None
        receive_from = None
        if owner != rank and (i == 0 or owners[i - 1] == rank):
            mine = next((j for j in range(i + 1, len(owners)) if owners[j] == rank), None)
            if mine is not None:
                receive_from = owners[mine - 1]
        hands_over = owner != rank and i + 1 < len(owners) and owners[i + 1] == rank
        routes.append(BlockRoute(owner == rank, send_to, receive_from, hands_over))
    return tuple(routes)


def post_holder(plan: StagePlan) -> int:
    """The pipeline rank that runs the modules after the blocks (final norm, head): the last stage's."""
    return plan.rank_of_stage(plan.num_stages - 1)
