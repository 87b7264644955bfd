"""The Fabric front end without processes: registered names, the options they share with the Trainer
presets, and the refusals at launch, before any collective."""

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
