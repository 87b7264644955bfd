"""The Fabric front end's parts: registered names, the options they share with the Trainer presets, the
refusals at launch (before any collective), and ``no_backward_sync`` on two processes."""

from __future__ import annotations

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_parallel  # noqa: F401 - registers the names
from lightning_parallel.errors import ConfigurationError, LightningParallelError
from lightning_parallel.fabric import FabricParallelStrategy, FabricTensorParallelStrategy
from lightning_parallel.strategy import TensorParallelStrategy
from lightning_parallel.lightning_hooks import STRATEGY_NAMES


def test_trainer_names_are_fabric_names():
    for name in STRATEGY_NAMES:
        assert name in STRATEGY_REGISTRY
    fabric = Fabric(accelerator="cpu", devices=2, strategy="lp_tp")
    assert isinstance(fabric.strategy, FabricTensorParallelStrategy)
    assert fabric.strategy.engine.options == TensorParallelStrategy().options


def test_same_options_as_the_trainer_strategy():
    kwargs = dict(tensor_parallel=2, sequence_parallel=True, zero_stage=3, bucket_size_mb=4.0)
    assert FabricTensorParallelStrategy(**kwargs).options == TensorParallelStrategy(**kwargs).options
    with pytest.raises(TypeError):
        FabricParallelStrategy(tensor_paralel=2)  # a misspelt option fails as the Trainer's does


def test_sizes_the_planner_chooses_are_refused_at_launch():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricParallelStrategy(tensor_parallel="auto"))
    with pytest.raises(ConfigurationError, match="give them as numbers"):
        fabric.strategy.setup_environment()  # first thing at launch, before the process group


def test_a_bad_layout_is_refused_at_launch_in_the_fabric_class_arguments():
    """Every rank runs the Trainer strategy's launch checks before its first collective; the fixes name
    the class the script built."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricParallelStrategy(tensor_parallel=2, data_parallel=2))
    with pytest.raises(LightningParallelError, match="needs 4 processes") as err:
        fabric.strategy.setup_environment()
    assert "FabricParallelStrategy(data_parallel=1)" in str(err.value)
    assert "Fabric(num_nodes=1, devices=4)" in str(err.value)


def _accumulate(rank: int, world_size: int) -> list[bool]:
    """Two backwards on different data per rank, the first inside ``no_backward_sync``: whether the ranks'
    gradients agree after each."""
    import os

    import torch
    import torch.distributed as dist

    from tests.fabric.loop import tiny_llama

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="lp_dp")
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(tiny_llama())
    agree = []
    for last in (False, True):
        batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * rank + last))
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(model(input_ids=batch, labels=batch).loss)
        grad = model.module.lm_head.weight.grad.clone()
        other = grad.clone()
        dist.broadcast(other, src=0)
        agree.append(torch.equal(grad, other))
    return agree


def test_no_backward_sync_keeps_gradients_local_until_the_window_ends():
    from tests.helpers.processes import run_distributed

    assert run_distributed(_accumulate, 2)[1] == [False, True]  # rank 1: its own gradient, then the mean
