"""`lp-train`: the Hydra entry point that trains a LightningModule under any strategy.

    lp-train                                           # defaults: GPT, stdlib bytes, strategy=dp, 2 CPU processes
    lp-train strategy=tp strategy.tensor_parallel=2
    lp-train strategy=pp trainer.devices=4 strategy.micro_batches=8
    lp-train strategy=single                           # the one-process reference
    lp-train dry_run=true strategy=3d trainer.devices=8  # print the plan, train nothing
    python -m lightning_parallel.train --cfg job       # print the composed config

Model, data, strategy and trainer are each built from their config group's `_target_`, so any
LightningModule or LightningDataModule trains with no change to this file. With the popen
launcher Lightning re-runs this same command for ranks 1..N-1, adding `hydra.run.dir=<this run's
folder>`, so every rank reads the same config and writes into the same folder.
"""

from __future__ import annotations

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_parallel.strategy import ParallelStrategy


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit `cfg.model` on `cfg.data` with `cfg.trainer`; return the final logged metrics."""
    if cfg.dry_run:
        from lightning_parallel.plan_cli import dry_run

        dry_run(cfg)
        return {}
    L.seed_everything(cfg.seed, workers=True)
    # plain Python arguments, so the hyperparameters saved in checkpoints load with weights_only
    datamodule = instantiate(cfg.data, _convert_="all")
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    # our strategies create the parameters on the meta device and materialise only what each rank
    # holds; other strategies (Lightning's own) build the model as usual
    with trainer.init_module(empty_init=isinstance(trainer.strategy, ParallelStrategy)):
        model = instantiate(cfg.model, _convert_="all")
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero and "val_loss" in metrics:
        print(f"final val_loss {metrics['val_loss']:.4f}")
    return metrics


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
