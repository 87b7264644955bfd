"""Launch mistakes that the composed config alone reveals, found before anything heavy is imported.

`lp-train` and `lp-plan` run these first: pipeline options (``micro_batches >= 1``, a known
schedule), and the files the config names (``ckpt_path``, ``data.path``). Each error states the
violated constraint and the override that fixes it. Layout and model checks, which need torch and
the model, follow in ``cli/launch_plan.py``'s ``build_plan``.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.errors import ConfigurationError, Fix
from lightning_parallel.options import ParallelOptions

# ckpt_path values Lightning resolves itself rather than reading a file
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


def strategy_options(cfg: DictConfig) -> dict:
    """The strategy's keyword arguments; Lightning's own strategies ("auto", "ddp") give none."""
    strategy = cfg.get("strategy")
    if not isinstance(strategy, DictConfig):
        return {}
    return OmegaConf.to_container(strategy, resolve=True)


def parallel_options(cfg: DictConfig) -> ParallelOptions:
    """The ``ParallelOptions`` a config's strategy trains with. The presets' "every process" (a size given
    as null: ``strategy=tp`` leaves ``tensor_parallel`` null) becomes the processes the other size leaves."""
    options = strategy_options(cfg)
    world = int(cfg.trainer.num_nodes) * int(cfg.trainer.devices)
    tp, pp = options.get("tensor_parallel", 1), options.get("pipeline_parallel", 1)
    sizes = {
        "tensor_parallel": tp if tp is not None else max(1, world // (pp if isinstance(pp, int) else 1)),
        "pipeline_parallel": pp if pp is not None else max(1, world // (tp if isinstance(tp, int) else 1)),
    }
    return ParallelOptions.from_mapping({**options, **sizes})


def check_config(cfg: DictConfig) -> None:
    """What the config alone decides: pipeline options, and that the files it names exist."""
    options = strategy_options(cfg)
    micro = options.get("micro_batches")
    if micro is not None and int(micro) < 1:
        raise ConfigurationError(
            f"strategy.micro_batches={micro}: a pipeline needs at least one micro-batch per batch; give a "
            f"number >= 1, or null for one per stage:", [Fix({"strategy.micro_batches": None})]
        )
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and str(ckpt) not in _LIGHTNING_CKPT_NAMES and not Path(str(ckpt)).exists():
        raise ConfigurationError(
            f"ckpt_path={ckpt} does not exist (relative paths start from {os.getcwd()}); give the checkpoint "
            "file or sharded checkpoint folder to resume from (e.g. ckpt_path=outputs/<date>/<time>/checkpoints/"
            "last.ckpt), or start afresh:", [Fix({"ckpt_path": None})]
        )
    data_path = cfg.data.get("path") if isinstance(cfg.get("data"), DictConfig) else None
    if data_path is not None and not Path(str(data_path)).exists():
        raise ConfigurationError(
            f"data.path={data_path} does not exist (relative paths start from {os.getcwd()}); give a text "
            "file or a folder of text files, or null for the bundled corpus:", [Fix({"data.path": None})]
        )
    schedule = options.get("schedule")
    if schedule is None or schedule == "auto":  # "auto": chosen with the layout (planner/auto.py)
        return
    from lightning_parallel.pipeline.schedules import (
        SCHEDULES,  # imports the whole pipeline package: last
    )

    if schedule not in SCHEDULES:
        nearest = (difflib.get_close_matches(str(schedule), SCHEDULES, n=1, cutoff=0.0) or list(SCHEDULES))[0]
        raise ConfigurationError(
            f"strategy.schedule={schedule!r} is not a pipeline schedule; the schedules are "
            f"{', '.join(SCHEDULES)}, e.g.", [Fix({"strategy.schedule": nearest})]
        )
