"""Lightning's rich progress bar, showing what a step-limited run needs.

`lp-train` stops at ``trainer.max_steps`` with ``max_epochs=-1``, which Lightning's bar renders
as ``Epoch 0/-2`` over the whole (long) epoch, next to the logger's version number as a float
(``v_num: 0.000``). This bar shows ``Epoch N`` alone when no epoch limit is set, counts up to
the batches the step limit leaves in the epoch, and drops ``v_num``.
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs < 0:
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)

    @property
    def total_train_batches(self) -> Union[int, float]:
        total = super().total_train_batches
        trainer = self.trainer
        if trainer.max_steps > 0 and trainer.current_epoch == 0:
            return min(total, trainer.max_steps * trainer.accumulate_grad_batches)
        return total

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
