"""A ``ModelCheckpoint`` that monitors what the module actually logs.

`lp-train` trains any LightningModule, so the config cannot name the metric to keep the best
checkpoint by. With ``monitor="auto"`` the choice is made at the first save, from the metrics
logged by then: ``val_loss`` if the module logs it, otherwise the first logged metric whose name
starts with ``val``; a module that logs no validation metric gets no monitor, and the checkpoint
kept is the latest one (``last.ckpt`` is written either way). ``mode`` is not guessed: give
``mode=max`` with an explicit ``monitor`` for accuracy-like metrics.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint


def pick_monitor(logged: list[str]) -> Optional[str]:
    """``val_loss`` if logged, else the first ``val*`` metric, else None."""
    if "val_loss" in logged:
        return "val_loss"
    return next((name for name in logged if name.startswith("val")), None)


class LoggedMetricCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``monitor="auto"`` follows the module's logged metrics."""

    def __init__(self, monitor: Optional[str] = "auto", **kwargs: Any) -> None:
        self.follows_logged_metrics = monitor == "auto"
        super().__init__(monitor=None if self.follows_logged_metrics else monitor, **kwargs)

    @property
    def state_key(self) -> str:
        # the key under which the callback's state is saved must not change once the monitor is picked
        if not self.follows_logged_metrics:
            return super().state_key
        return self._generate_state_key(monitor="auto", mode=self.mode, every_n_train_steps=self._every_n_train_steps,
                                        every_n_epochs=self._every_n_epochs, train_time_interval=self._train_time_interval)

    def _monitor_candidates(self, trainer) -> dict:
        candidates = super()._monitor_candidates(trainer)
        if self.follows_logged_metrics and self.monitor is None:
            self.monitor = pick_monitor(list(trainer.callback_metrics))
        return candidates
