"""Relayed forwards (``pipeline/relay_route.py``): every rank's own blocks get the hidden state the block
before them produced, and every send is matched by the receive its destination expects, in the same order.
Checked on the plain placement, several stages per rank, and the V placement (a rank holds the first and
the last stage)."""

from __future__ import annotations

import pytest

from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.pipeline.relay_route import block_routes, post_holder


def _plan(sizes: list[int], ranks: int, placement: str = "loop") -> StagePlan:
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return StagePlan("blocks", tuple(range(a, a + n) for a, n in zip(starts, sizes)), ("embed",), ("head",), ranks,
                     True, placement)


@pytest.mark.parametrize("sizes, ranks, placement", [
    ([2, 2], 2, "loop"),
    ([1, 2, 1, 3], 4, "loop"),
    ([1, 1, 2, 1, 1, 2], 2, "loop"),  # three stages per rank
    ([2, 1, 1, 2], 2, "v"),  # rank 0: stages 0 and 3, rank 1: stages 1 and 2
])
def test_each_block_of_a_rank_gets_the_previous_blocks_output_and_sends_match_receives(sizes, ranks, placement):
    plan = _plan(sizes, ranks, placement)
    n = sum(sizes)
    routes = {r: block_routes(plan, r) for r in range(ranks)}
    owner = [next(r for r in range(ranks) if routes[r][i].owned) for i in range(n)]
    assert all(sum(routes[r][i].owned for r in range(ranks)) == 1 for i in range(n))
    sent: dict[tuple[int, int], list[int]] = {}  # (from, to) -> the blocks whose input was sent, in order
    received: dict[tuple[int, int], list[int]] = {}  # (from, to) -> the blocks the receiver takes it for
    for r in range(ranks):
        for i, route in enumerate(routes[r]):
            if route.send_to is not None:
                assert owner[i - 1] == r and route.send_to == owner[i] != r
                sent.setdefault((r, route.send_to), []).append(i)
            if route.receive_from is not None:
                assert not route.owned
                mine = next(j for j in range(i + 1, n) if owner[j] == r)
                assert route.receive_from == owner[mine - 1]  # whoever ran the block just before
                received.setdefault((route.receive_from, r), []).append(mine)
            assert route.hands_over == (not route.owned and i + 1 < n and owner[i + 1] == r)
    assert sent == received
    crossings = [i for i in range(1, n) if owner[i] != owner[i - 1]]
    assert sorted(i for blocks in sent.values() for i in blocks) == crossings
    assert post_holder(plan) == owner[-1]
