"""The first hour of a new user: `lp-train`, `lp-plan` and the timeline run as real commands.

Every test starts the console script in a subprocess, in a fresh folder, as a user would, with a
tiny model and a few steps. Losses are read from the CSV metrics the run writes. They compare
runs of the same float32 computation in the same order (one process, or ranks that exchange the
very values one process would compute), so they agree to within float32 reassociation error;
1e-5 is far below the ~0.1 change one optimizer step or a different batch makes.
"""

import csv
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_parallel.cli.launch_plan import build_plan
from lightning_parallel.cli.overrides import compose_config

TINY = [
    "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
    "data.batch_size=8", "data.max_bytes=200000", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
]
LOSS_ATOL = 1e-5


def _run(args, cwd, timeout=150, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


OWN_PACKAGE = '''
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModule(L.LightningModule):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MyData(L.LightningDataModule):
    def setup(self, stage=None):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):  # 8 batches an epoch, fewer than the default val_check_interval
        return DataLoader(self.data, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=32)
'''


@pytest.mark.timeout(120)
def test_own_module_and_data_train_from_the_readme_command_line(tmp_path):
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text(textwrap.dedent(OWN_PACKAGE))
    result = _run(
        ["lp-train", "model=custom", "model._target_=my_pkg.MyModule", "data=custom", "data._target_=my_pkg.MyData",
         "strategy=single", "trainer.max_steps=20", "trainer.val_check_interval=10", "+model.hidden=16"],
        cwd=tmp_path,
    )
    (run,) = [p.parent for p in tmp_path.glob("outputs/*/*/.hydra")]
    # the checkpoint follows what the module logs: val_mse, not the GPT's val_loss
    assert "could not find the monitored key" not in result.stderr
    best = re.search(r"best\s+(\S+) \(val_mse ", result.stdout)
    assert best and Path(best.group(1)).exists()
    assert (run / "checkpoints" / "last.ckpt").exists()
    # the start and end blocks reach train.log too, once
    log = (run / "train.log").read_text()
    assert log.count("run folder") == 1 and "metrics" in log and "val_mse" in log


@pytest.mark.timeout(240)
def test_single_dp_tp_pp_start_from_the_same_step0_loss(tmp_path):
    layouts = {
        "single": ["strategy=single"],
        "tp2": ["strategy=tp", "trainer.devices=2"],
        "pp2": ["strategy=pp", "trainer.devices=2", "strategy.micro_batches=2"],
    }
    first = {}
    for name, overrides in layouts.items():
        _run(["lp-train", *TINY, *overrides, "trainer.max_steps=1", "trainer.val_check_interval=1",
              f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
        first[name] = _train_losses(tmp_path / name)[0]
    for name, loss in first.items():
        assert loss == pytest.approx(first["single"], abs=LOSS_ATOL), first


@pytest.mark.timeout(240)
def test_resume_from_a_mid_epoch_checkpoint_reproduces_the_uninterrupted_losses(tmp_path):
    # two data-parallel replicas: the position to resume from is each replica's share of the epoch
    common = [*TINY, "strategy=dp", "trainer.devices=2", "trainer.max_steps=6", "trainer.val_check_interval=3",
              "+callbacks.model_checkpoint.save_top_k=-1"]
    full = _run(["lp-train", *common, f"hydra.run.dir={tmp_path / 'full'}"], cwd=tmp_path)
    ckpt = tmp_path / "full" / "checkpoints" / "epoch=0-step=3.ckpt"
    resumed = _run(["lp-train", *common, f"hydra.run.dir={tmp_path / 'resumed'}", f"ckpt_path='{ckpt}'"],
                   cwd=tmp_path)
    uninterrupted, after = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "resumed")
    assert sorted(after) == [3, 4, 5]
    for step, loss in after.items():
        assert loss == pytest.approx(uninterrupted[step], abs=LOSS_ATOL), (step, uninterrupted, after)
    # quiet: none of the known-harmless notices, and a progress bar that knows no epoch limit
    for output in (full.stdout + full.stderr, resumed.stdout + resumed.stderr):
        for noise in ("srun` command", "tensorboardX", "Tip:", "LeafSpec", "dirpath has changed",
                      "dataloader is not resumable", "Epoch 0/-2", "v_num", "GLOBAL_RANK: 1"):
            assert noise not in output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override, message", [
    ("strategy.micro_batches=0", "strategy.micro_batches=null"),
    ("ckpt_path=missing.ckpt", "ckpt_path=missing.ckpt does not exist"),
])
def test_config_mistakes_stop_the_launch_before_any_rank_starts(tmp_path, override, message):
    result = _run(["lp-train", "strategy=pp", override], cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Initializing distributed" not in result.stdout + result.stderr
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.timeout(60)
def test_mistyped_key_gets_did_you_mean(tmp_path):
    result = _run(["lp-train", "strategy=pp", "trainer.max_step=3"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "did you mean trainer.max_steps?" in result.stderr
    # the whole command, the user's other overrides kept, as it passes the launch checks
    assert "\n    lp-train strategy=pp trainer.max_steps=3\n" in result.stderr
    build_plan(compose_config(["strategy=pp", "trainer.max_steps=3"]), env={})


def _suggested_overrides(stderr: str) -> list[list[str]]:
    """The overrides of each command line printed after "Launches that pass every check:"."""
    lines = stderr.split("Launches that pass every check:\n")[1].splitlines()
    commands = [shlex.split(line.split("   #")[0].split("   (sbatch")[0]) for line in lines if line.startswith("    ")]
    assert all(command[0] == "lp-plan" for command in commands)
    return [command[1:] for command in commands]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides", [
    # TP=8 cannot stay inside a node of 4 devices
    ["strategy=3d", "trainer.num_nodes=2", "trainer.devices=4", "strategy.tensor_parallel=8",
     "strategy.pipeline_parallel=1"],
    # 3 processes for TP2 x PP2; tp=3 fits 3 processes but not the model's 4 heads
    ["strategy=3d", "trainer.devices=3", "model.n_head=4"],
])
def test_lp_plan_prints_only_fixes_that_pass_its_own_checks(tmp_path, overrides):
    result = _run(["lp-plan", *overrides], cwd=tmp_path, check=False)
    assert result.returncode == 1
    fixes = _suggested_overrides(result.stderr)
    assert fixes
    for fix in fixes:
        assert not any(f.startswith(("strategy.tensor_parallel=3", "+strategy.tensor_parallel=3")) for f in fix)
        # the user's overrides come first, in order (a fix changes a value in place, or adds a key after them)
        assert [o.split("=")[0] for o in fix[: len(overrides)]] == [o.split("=")[0] for o in overrides]
        build_plan(compose_config(fix), env={})  # raises if the command does not pass


@pytest.mark.timeout(60)
def test_fast_commands_do_not_import_lightning(tmp_path):
    commands = {
        "import": [sys.executable, "-X", "importtime", "-c", "import lightning_parallel"],
        "cfg job": [sys.executable, "-X", "importtime", "-m", "lightning_parallel.cli.train", "--cfg", "job"],
    }
    for name, command in commands.items():
        imported = _run(command, cwd=tmp_path).stderr
        # imported by the command, or already at start-up by lightning_parallel.pth
        assert re.search(r"\|\s+lightning_parallel$", imported, re.M), name
        assert not re.search(r"\|\s+lightning(\.|$)", imported, re.M), name


@pytest.mark.timeout(60)
def test_timeline_writes_the_path_given_and_refuses_nothing_to_draw(tmp_path):
    out = tmp_path / "sub" / "timeline.png"
    _run([sys.executable, "-m", "lightning_parallel.pipeline.timeline", "--stages", "2", "--micro-batches", "4",
          "--out", str(out)], cwd=tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.rglob("*.png")) == [out]

    from benchmarks.timeline import _load_rank
    from lightning_parallel.pipeline.timeline import TimelineError, render

    (tmp_path / "rank0.pt").write_bytes(b"")
    with pytest.raises(TimelineError, match="rank 0 left no intervals"):
        _load_rank(str(tmp_path / "rank0.pt"), 0)
    with pytest.raises(TimelineError, match="nothing to draw"):
        render(str(tmp_path / "empty.png"), 2, 4, "1f1b", measured=[])
