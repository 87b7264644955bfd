"""One short block at the start and at the end of a run: where things go, the layout, the result.

Printed once per job (global rank 0) through the ``lightning_parallel`` logger, so it lands on the
console and in Hydra's ``train.log`` of the run folder.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

log = logging.getLogger("lightning_parallel")


def _log_file() -> Optional[str]:
    """Hydra's log file of this job (rank 0's; rank N writes ``<job>_ddp_process_N.log`` beside it)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    return str(Path(hydra.runtime.output_dir) / f"{hydra.job.name}.log")


def _blocks(blocks: range) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else str(blocks[0])


def layout_lines(plan: Any) -> list[str]:
    """The mesh, TP plan and pipeline stage split of a ``cli.launch_plan.LaunchPlan``."""
    mesh = plan.mesh
    lines = [f"layout       {mesh.sizes()} on {plan.num_nodes} node(s) x {plan.devices_per_node} devices; "
             f"{plan.model_name}, {plan.parameters / 1e6:,.2f}M parameters"]
    if plan.tp_plan:
        lines.append("tp plan      " + ", ".join(f"{k} (x{n})" for k, n in plan.tp_plan.items()))
    if plan.share is not None and (mesh.tp_size > 1 or mesh.pp_size > 1):
        lines.append(f"planned      {plan.share.describe()}")
    stages = plan.stages
    if stages is not None and mesh.pp_size > 1:
        split = "; ".join(f"stage {s}: {stages.blocks_path} {_blocks(b)}" for s, b in enumerate(stages.stage_blocks))
        lines.append(f"pp stages    {split} (first also {', '.join(stages.pre) or '-'}; last also "
                     f"{', '.join(stages.post) or '-'})")
    return lines


class RunSummary(Callback):
    """Logs the run's outputs and layout when fitting starts, what the split check compared once it ran
    (at setup under pipeline parallelism, else in the first step: ``checks/first_step.py``), and the final
    metrics when fitting ends."""

    def __init__(self, plan: Any = None) -> None:
        self.plan = plan
        self._start = time.monotonic()
        self._verified = False

    def _checkpoint(self, trainer) -> Optional[ModelCheckpoint]:
        return next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._start = time.monotonic()
        if not trainer.is_global_zero:
            return
        lines = [f"run folder   {trainer.default_root_dir}"]
        checkpoint = self._checkpoint(trainer)
        if checkpoint is not None:
            best = checkpoint.monitor or ("val_loss or the first val* metric logged"
                                          if getattr(checkpoint, "follows_logged_metrics", False) else "the latest step")
            lines.append(f"checkpoints  {checkpoint.dirpath} (last.ckpt, and the best by {best})")
        if (log_file := _log_file()) is not None:
            lines.append(f"log          {log_file}")
        for logger in trainer.loggers:
            where = logger.log_dir or logger.save_dir
            if isinstance(logger, CSVLogger):
                where = Path(where) / "metrics.csv"
            lines.append(f"metrics      {where}")
        if trainer.ckpt_path:
            lines.append(f"resumed from {trainer.ckpt_path}")
        if self.plan is not None:
            lines += layout_lines(self.plan)
        share = getattr(trainer.strategy, "parameter_share", None)  # measured once split (checks/share.py)
        if share is not None:
            lines.append(f"holds        {share.describe()}")
        log.info("\n".join(lines))
        self._report_verification(trainer)

    def _report_verification(self, trainer) -> None:
        verified = getattr(trainer.strategy, "split_verification", None)
        if verified is not None and not self._verified and trainer.is_global_zero:
            self._verified = True
            log.info(f"verified     {verified.describe()}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._report_verification(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        lines = [f"finished     step {trainer.global_step} in {time.monotonic() - self._start:.0f} s"]
        if metrics:
            lines.append("metrics      " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if "val_loss" in metrics:
            lines.append(f"final val_loss {metrics['val_loss']:.4f}")
        checkpoint = self._checkpoint(trainer)
        if checkpoint is not None:
            if checkpoint.best_model_path and checkpoint.monitor:
                lines.append(f"best         {checkpoint.best_model_path} ({checkpoint.monitor} "
                             f"{float(checkpoint.best_model_score):.4f})")
            if checkpoint.last_model_path:
                lines.append(f"last         {checkpoint.last_model_path}")
        log.info("\n".join(lines))
