"""What a restarted replica group copies from a live one: everything one training step reads.

The module's parameters and buffers (this rank's part of them: its TP shard, its pipeline stage), the
optimizers' and learning-rate schedulers' states, and the Trainer's step counters, so that the copy
stops at ``max_steps`` with the groups it joined and logs at their steps. Every rank of a group copies
from the rank at the same place in the live group, which holds the same part of the model. The data
position is not copied: a restarted group reads its share of the data from the start of its loader.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.compat import set_training_steps, training_steps


def trainer_state(trainer: Any) -> dict[str, Any]:
    """This rank's training state, as a live group sends it."""
    return {
        "module": trainer.lightning_module.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "steps": training_steps(trainer),
    }


def load_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    """Take a live group's ``trainer_state`` in place (parameters keep their identity, so optimizers,
    gradient hooks and buckets stay valid)."""
    trainer.lightning_module.load_state_dict(state["module"])
    for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"]):
        optimizer.load_state_dict(optimizer_state)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    set_training_steps(trainer, *state["steps"])
