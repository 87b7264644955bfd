"""``load_state_dict`` of the unsplit model's state dict into a TP-split module: each rank copies its slice
(``strategy/whole_state_dict.py``); one process, the split written by hand as tensor parallelism leaves it."""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.strategy.whole_state_dict import accept_whole_state_dicts
from lightning_parallel.tensor_parallel.shard import TPShard, slice_shard


def split_like_rank(whole: nn.Linear, shard: TPShard, rank: int, tp_size: int) -> nn.Linear:
    """``whole``'s rank-``rank`` part: its weight sliced along ``shard``, its bias left whole."""
    part = nn.Linear(whole.in_features, whole.out_features)
    part.weight = nn.Parameter(torch.zeros_like(slice_shard(whole.weight.detach(), shard, rank, tp_size)))
    part.weight.tp_shard = shard
    accept_whole_state_dicts(part, rank, tp_size)
    return part


def test_a_whole_state_dict_loads_each_ranks_slice_of_a_fused_weight(tmp_path):
    torch.manual_seed(0)
    whole = nn.Linear(4, 12)  # a fused [q; k; v] projection
    shard = TPShard(dim=0, fused=3)
    for rank in range(2):
        part = split_like_rank(whole, shard, rank, 2)
        part.load_state_dict(whole.state_dict())
        assert torch.equal(part.weight, slice_shard(whole.weight.detach(), shard, rank, 2))
        assert torch.equal(part.bias, whole.bias)
        # a state dict of the split module itself fits already: loaded as it is
        again = split_like_rank(whole, shard, rank, 2)
        again.load_state_dict(part.state_dict())
        assert torch.equal(again.weight, part.weight)


def test_a_lazily_read_whole_state_dict_loads_too(tmp_path):
    from lightning.fabric.utilities.load import _lazy_load

    torch.manual_seed(0)
    whole = nn.Linear(4, 6)
    torch.save(whole.state_dict(), tmp_path / "model.pth")
    shard = TPShard(dim=1)
    part = split_like_rank(whole, shard, 1, 2)
    part.load_state_dict(_lazy_load(tmp_path / "model.pth"))
    assert torch.equal(part.weight, slice_shard(whole.weight.detach(), shard, 1, 2))
