"""The replica-group contract without processes: the keys of every strategy preset reach the strategy,
bad values are refused at configuration with what would work, and ``lp-lighthouse`` reads its flags."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import LightningEnvironment
from omegaconf import OmegaConf

from lightning_parallel.cli.launch_plan import build_plan
from lightning_parallel.cli.lighthouse import parse_args
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.fault_tolerance.groups import refuse_unsupported_training
from lightning_parallel.options import ParallelOptions
from lightning_parallel.strategy import ParallelStrategy

CONF = Path(__file__).parents[2] / "lightning_parallel" / "conf" / "strategy"
PRESETS = ["3d", "auto", "cp", "dp", "ep", "pp", "tp"]  # ddp is Lightning's own, single the one-device reference
ADDRESS = "http://node-0:29510"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_starts_one_replica_group_from_the_command_line(preset):
    cfg = compose_config([f"strategy={preset}", "strategy.replica_groups=3", "strategy.replica_group=2",
                          f"strategy.lighthouse={ADDRESS}"])
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, ParallelStrategy)
    assert (strategy.options.replica_groups, strategy.options.replica_group, strategy.options.lighthouse) == (
        3, 2, ADDRESS)


def test_one_group_by_default_in_every_preset():
    for preset in PRESETS:
        values = OmegaConf.load(CONF / f"{preset}.yaml")
        assert (values.replica_groups, values.replica_group, values.lighthouse) == (1, 0, None), preset
    assert ParallelOptions().replica_groups == 1


def test_several_groups_without_a_lighthouse_stop_the_launch():
    with pytest.raises(ConfigurationError, match="lighthouse='http://HOST:PORT'.*lp-lighthouse --port"):
        build_plan(compose_config(["strategy=dp", "strategy.replica_groups=2"]), env={})


@pytest.mark.parametrize("kwargs, message", [
    (dict(replica_groups=2, replica_group=2, lighthouse=ADDRESS), "replica_group must be one of 0..1"),
    (dict(replica_groups=2, replica_group=-1, lighthouse=ADDRESS), "replica_group must be one of 0..1"),
    (dict(replica_groups=0), "replica_groups must be a positive integer"),
    (dict(replica_groups=2, lighthouse="node-0:29510"), "lighthouse='http://HOST:PORT'"),
    (dict(replica_groups=2, lighthouse=ADDRESS, zero_stage=3), "zero_stage 0 or 1 inside each replica group"),
])
def test_bad_replica_options_are_refused_with_what_works(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        ParallelOptions(**kwargs)


def test_replica_groups_split_the_data_between_them(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second data-parallel rank of group 2: sample shard 2 * 2 + 1 of 6
    strategy = ParallelStrategy(replica_groups=3, replica_group=2, lighthouse=ADDRESS,
                                parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LightningEnvironment())
    strategy.set_world_ranks()
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 5}


def test_lp_lighthouse_flags():
    args = parse_args(["--port", "29510", "--min-replicas", "2", "--heartbeat-timeout-ms", "3000"])
    assert (args.port, args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms) == (29510, 2, 60000, 3000)
    with pytest.raises(SystemExit):
        parse_args(["--port", "29510", "--min-replicas", "0"])


@pytest.mark.parametrize("automatic, optimizers, accumulate, message", [
    (False, 1, 1, "manual optimisation"),
    (True, 2, 1, "2 optimizers"),
    (True, 1, 4, "accumulate_grad_batches=4"),
])
def test_training_that_commits_more_than_once_per_batch_is_refused(automatic, optimizers, accumulate, message):
    trainer = SimpleNamespace(lightning_module=SimpleNamespace(automatic_optimization=automatic),
                              optimizers=[object()] * optimizers, accumulate_grad_batches=accumulate)
    with pytest.raises(ConfigurationError, match=message):
        refuse_unsupported_training(trainer)
    refuse_unsupported_training(SimpleNamespace(lightning_module=SimpleNamespace(automatic_optimization=True),
                                                optimizers=[object()], accumulate_grad_batches=1))
