"""`lp-train`: the Hydra entry point that trains a LightningModule under any strategy.

    lp-train                                           # defaults: GPT, stdlib bytes, strategy=dp, 2 CPU processes
    lp-train strategy=tp strategy.tensor_parallel=2
    lp-train strategy=pp trainer.devices=4 strategy.micro_batches=8
    lp-train strategy=single                           # the one-process reference
    lp-train model=custom model._target_=my_pkg.MyModule data=custom data._target_=my_pkg.MyData
    lp-train dry_run=true strategy=3d trainer.devices=8  # print the plan, train nothing
    lp-train ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt   # resume, data position included
    python -m lightning_parallel.cli.train --cfg job       # print the composed config

Model, data, strategy and trainer are each built from their config group's `_target_`, so any
LightningModule or LightningDataModule trains with no change to this file (`model=custom` and
`data=custom` are empty groups for your own classes; their constructor arguments go in with `+`,
e.g. `+model.hidden=64`). With the popen launcher Lightning re-runs this same command for ranks
1..N-1, adding `hydra.run.dir=<this run's folder>`, so every rank reads the same config and writes
into the same folder.

Every `lp-*` command enters the same way (``cli/entry.py``): the folder it runs in is importable,
and a mistyped key or a class of one's own given to a default config is answered with the command
that works. Before Lightning is even imported, the launching process checks everything the config
alone decides (``cli/launch_plan.py``'s ``check_launch``: sizes, layout, the model's divisibility on the
meta device, the batch shape read from the data, pipeline options, paths), so a bad launch fails
in seconds, with fixes printed as whole command lines that pass the same checks, before any rank
starts.
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_parallel.cli.entry import enter_command
from lightning_parallel.cli.overrides import split_flags
from lightning_parallel.cli.suggest import command_line
from lightning_parallel.errors import ConfigurationError, LaunchError

log = logging.getLogger("lightning_parallel")


def _build_model(cfg: DictConfig, trainer):
    """The model, with the values one device would build it with, on every layout (one device included).

    It is built on the meta device, recording how construction sets each parameter (empty_init.py):
    our strategies then give each rank only its part, every other strategy materialises it whole
    through the same function, so that `strategy=single` is the reference the parallel runs start
    from. Where construction does something that cannot be replayed on meta (``init=auto``), the
    model is built with values on the host instead when it fits there (a copy per local process),
    and refused with the reason when it does not; so is one whose construction reads a value that is
    not known on meta before materialisation (``MetaConstructionError``). ``init=host`` or
    ``init=meta`` forces one.
    """
    import torch

    from lightning_parallel.errors import MetaConstructionError
    from lightning_parallel.strategy import ParallelStrategy
    from lightning_parallel.strategy.empty_init import unreplayable
    from lightning_parallel.strategy.materialize import (
        UnsplitModel,
        empty_parameters,
        materialize,
    )

    ours = isinstance(trainer.strategy, ParallelStrategy)
    start = torch.get_rng_state()
    if cfg.get("init", "auto") != "host":
        try:
            if ours:
                with trainer.init_module(empty_init=True):
                    model = instantiate(cfg.model, _convert_="all")
            else:
                with trainer.init_module(empty_init=False), empty_parameters():
                    model = instantiate(cfg.model, _convert_="all")
        except Exception as error:  # noqa: BLE001 - Hydra wraps what the constructor raised
            refusal = error
            while refusal is not None and not isinstance(refusal, MetaConstructionError):
                refusal = refusal.__cause__
            if refusal is None or cfg.get("init") == "meta":  # not a value read on meta, or meta was asked
                raise
            log.info("model built on the host: %s", refusal)
            torch.set_rng_state(start)
            with trainer.init_module(empty_init=False):
                return instantiate(cfg.model, _convert_="all")
        problems = unreplayable(model)
        if not problems:
            log.info("model built on the meta device: each process materialises its part (init=meta)")
            if not ours:
                materialize(model, UnsplitModel.of(model), 0, 1, trainer.strategy.root_device, torch.initial_seed())
            return model
        _host_or_refuse(cfg, model, problems, trainer.num_devices)
        torch.set_rng_state(start)  # the values the host build draws are those of a first build
    with trainer.init_module(empty_init=False):
        return instantiate(cfg.model, _convert_="all")


def _host_or_refuse(cfg: DictConfig, model, problems: dict[str, str], processes: int) -> None:
    """Log why the model is built on the host; raise where it must stay on meta or does not fit there."""
    import os

    from lightning_parallel.errors import ConfigurationError

    name, why = next(iter(problems.items()))
    reason = f"{name} ({why}" + (f", and {len(problems) - 1} more)" if len(problems) > 1 else ")")
    need = sum(p.numel() * p.element_size() for p in model.parameters()) * processes
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cfg.get("init", "auto") == "meta" or need > memory / 2:
        raise ConfigurationError(
            f"{type(model).__name__} cannot be built on the meta device: {reason} cannot be replayed there, and "
            + ("init=meta was asked" if cfg.get("init") == "meta" else
               f"{processes} copies of it ({need / 2**30:.1f} GiB) do not fit in half of this host's "
               f"{memory / 2**30:.0f} GiB")
            + "; set that parameter in the constructor with torch.nn.init functions, a tensor, or "
              "load_state_dict (they are replayed), or train it where it fits:\n    init=host"
        )
    log.info("model built on the host, %d copies of %.1f GiB: %s cannot be replayed on the meta device",
             processes, need / processes / 2**30, reason)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit `cfg.model` on `cfg.data` with `cfg.trainer`; return the final logged metrics."""
    if cfg.dry_run:
        from lightning_parallel.cli.launch_plan import dry_run

        dry_run(cfg)
        return {}
    from lightning_parallel.cli.config_checks import check_config

    check_config(cfg)  # seconds before torch and Lightning are imported
    from lightning_parallel.cli.launch_plan import check_launch

    plan = check_launch(cfg)

    from hydra.core.hydra_config import HydraConfig

    from lightning_parallel.cli.quiet import quiet_known_warnings, quiet_resume_warning

    # hydra.verbose=true (or naming loggers) asks for Lightning's own notices too
    quiet_known_warnings(banner=HydraConfig.initialized() and bool(HydraConfig.get().verbose))
    import lightning as L

    if logging.getLogger().handlers:  # Hydra's console and train.log handlers; Lightning's own would repeat each line
        logging.getLogger("lightning").handlers.clear()
    from lightning_parallel.cli.run_summary import RunSummary

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    # plain Python arguments, so the hyperparameters saved in checkpoints load with weights_only
    datamodule = instantiate(cfg.data, _convert_="all")
    quiet_resume_warning(datamodule)
    callbacks = [RunSummary(plan)] + [instantiate(c) for c in cfg.callbacks.values()]  # its block first
    trainer = instantiate(cfg.trainer, callbacks=callbacks)
    model = _build_model(cfg, trainer)
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@hydra.main(config_path="pkg://lightning_parallel.conf", config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except (ConfigurationError, LaunchError) as err:  # the launch checks here, or the strategy in its words
        from hydra.core.hydra_config import HydraConfig

        from lightning_parallel.cli.launch_plan import explain_failure

        message = explain_failure(err, "lp-train", list(HydraConfig.get().overrides.task), cfg) if err.fixes else err
        print(f"lp-train: this launch would fail:\n{message}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    split = split_flags(sys.argv[1:])  # None: --multirun and the like, whose overrides are Hydra's to read
    enter_command(command_line("lp-train", split[0]) if split else "lp-train", split[1] if split else None)
    _hydra_main()


if __name__ == "__main__":
    main()
