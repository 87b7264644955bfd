"""The Fabric front end without processes: registered names, the options they share with the Trainer
presets, and the refusals at launch, before any collective."""

from __future__ import annotations

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_parallel  # noqa: F401 - registers the names
from lightning_parallel.errors import ConfigurationError
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


def test_context_parallelism_is_refused_at_launch():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricParallelStrategy(context_parallel=2))
    with pytest.raises(ConfigurationError, match="context_parallel under Fabric") as err:
        fabric.strategy.setup_environment()  # first thing at launch, before the process group
    assert "Trainer(strategy=ParallelStrategy(" in str(err.value)
