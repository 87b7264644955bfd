"""The end-of-step broadcast of the last stage's loss and log records (one collective when small)."""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.pipeline import broadcast
from tests.helpers.processes import run_distributed


def _broadcast(rank, world, size):
    calls = []
    original = dist.broadcast

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.broadcast = counting
    try:
        obj = {"loss": torch.tensor(2.5), "records": [("train_loss", torch.tensor(1.0), {"prog_bar": True})],
               "blob": b"x" * size} if rank == world - 1 else None
        got = broadcast.broadcast_object(obj, world - 1, dist.group.WORLD, torch.device("cpu"), rank == world - 1)
    finally:
        dist.broadcast = original
    return got["loss"].item(), got["records"][0][0], len(got["blob"]), len(calls)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size, collectives", [(100, 1), (3 * broadcast.CAPACITY, 2)])
def test_object_reaches_every_rank_in_one_collective_unless_large(size, collectives):
    for loss, name, blob, calls in run_distributed(_broadcast, 3, size):
        assert (loss, name, blob, calls) == (2.5, "train_loss", size, collectives)
