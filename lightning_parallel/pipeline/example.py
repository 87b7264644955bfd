"""The first batch of the loop a Trainer is about to run: the example the pipeline traces at setup.

Pipeline stages are cut at the order the model's modules run in (``order.py``), which one forward
shows. At ``Strategy.setup`` the Trainer has not built its loaders yet, so the batch comes straight
from the loop's data source (the loader passed to ``fit``/``validate``/..., or the
``*_dataloader`` hook of the module or datamodule), with the random number generators restored
afterwards: a shuffling loader then draws, for the run itself, the order it would have drawn.
Reads Lightning's private ``loop._data_source`` (``compat.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from lightning_parallel.compat import loop_data_source

_LOOPS = {
    TrainerFn.FITTING: ("fit_loop", "training_step", "max_size_cycle"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step", "sequential"),
    TrainerFn.TESTING: ("test_loop", "test_step", "sequential"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step", "sequential"),
}


def first_batch(trainer: Any, strategy: Any) -> tuple[Optional[Any], str]:
    """``(batch on the strategy's device, name of the step that receives it)``; the batch is None
    when the loop has no data source."""
    loop_name, step, mode = _LOOPS[trainer.state.fn]
    source = loop_data_source(trainer, loop_name)
    if source.instance is None or not source.is_defined():
        return None, step
    devices = [strategy.root_device] if strategy.root_device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        loader = source.dataloader()
        combined = loader if isinstance(loader, CombinedLoader) else CombinedLoader(loader, mode)
        try:
            batch = next(iter(combined))[0]
        except StopIteration:
            return None, step
    # as the loops do: on the device, then in the precision's dtype (``64-true`` makes inputs float64)
    return strategy.precision_plugin.convert_input(strategy.batch_to_device(batch)), step
