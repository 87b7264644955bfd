"""The note on the training batches' order (``strategy/data_order.py``), for each kind of loader."""

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_parallel.strategy.data_order import data_order_note

DATA = list(range(16))


def distributed(shuffle: bool) -> DataLoader:
    return DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=shuffle))


def test_a_shuffling_distributed_sampler_is_noted_with_the_fix_for_the_replicas():
    one = data_order_note([distributed(True)], distributed_sampler=True, replicas=1)
    assert "on 1 device(s)" in one and "use_distributed_sampler=False" in one
    two = data_order_note({"a": distributed(True)}.values(), distributed_sampler=True, replicas=2)
    assert "DistributedSampler(dataset, shuffle=False, **trainer.distributed_sampler_kwargs)" in two


def test_loaders_that_keep_their_order_are_not_noted():
    in_order = DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), 2, False))
    assert data_order_note([in_order, distributed(False)], distributed_sampler=True, replicas=2) is None
    assert data_order_note([distributed(True)], distributed_sampler=False, replicas=2) is None
