"""A module and data module of one's own, in a folder outside the package, through every command.

Each test writes a package of its own (``my_pkg``: a token model with repeated blocks, a data
module that shuffles and saves no hyperparameters, a model with nothing to split) into a fresh
folder and runs the real command there, as a new user would: `lp-plan` in this process (its
``main``, in that folder), `lp-train`, a `LightningCLI` script and a plain training script in
subprocesses. Every command line a command prints is pasted back and must pass the launch checks
(``cli/launch_plan.py``, what `lp-train` runs before any rank starts).
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_parallel.cli.launch_plan import build_plan
from lightning_parallel.cli.overrides import compose_config
from lightning_parallel.cli.plan import main as lp_plan_main
from tests.helpers.parity import LOSS_BOUND

MY_PKG = '''
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(L.LightningModule):
    """Repeated blocks; the sizes the layout search reads are its hyperparameters."""

    def __init__(self, vocab_size: int = 32, n_embd: int = 16, n_head: int = 2, n_layer: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd) for _ in range(n_layer))
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShuffledTokens(L.LightningDataModule):
    """Shuffles its training data and saves no hyperparameters: its batch shape shows in a batch only."""

    def __init__(self, batch_size: int = 8, samples: int = 64, seq: int = 8):
        super().__init__()
        self.batch_size, self.samples, self.seq = batch_size, samples, seq

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 32, (self.samples, self.seq), generator=g)
        self.data = TensorDataset(x, x.roll(1, 1))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class Flat(L.LightningModule):
    """Nothing tensor parallelism splits; one block list, of unlike layers."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
'''

OWN = ["model=custom", "model._target_=my_pkg.TinyLM", "data=custom", "data._target_=my_pkg.ShuffledTokens"]
LOSS_ATOL = LOSS_BOUND  # the documented float32 parity bound (tests/helpers/parity.py)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A fresh folder holding ``my_pkg``, as the working directory; this process's import path and
    modules are restored afterwards (``lp-plan`` puts the folder on the path, as every command does)."""
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text(textwrap.dedent(MY_PKG))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("my_pkg", None)


def lp_plan(capsys, *args: str) -> tuple[int, str, str]:
    """``lp-plan args`` in this process: (exit status, stdout, stderr)."""
    try:
        lp_plan_main(list(args))
        status = 0
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def printed_commands(text: str) -> list[list[str]]:
    """Every command line a command printed (indented ``lp-train``/``lp-plan`` lines), as argv."""
    lines = [line.split("   #")[0].split("   (sbatch")[0] for line in text.splitlines()]
    return [shlex.split(line) for line in lines if re.match(r"\s+lp-(train|plan)\b", line)]


def assert_passes_launch_checks(command: list[str]) -> None:
    """Paste ``command``: its overrides compose and pass the checks `lp-train` runs before any rank."""
    overrides = [a for a in command[1:] if "=" in a and not a.startswith("-")]
    build_plan(compose_config(overrides), env={})


def run(args: list[str], cwd: Path, timeout: int = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


# 1, 2: lp-plan finds the user's package and reads the batch shape from its data
@pytest.mark.timeout(60)
def test_lp_plan_imports_the_users_package_and_estimates_memory_from_its_first_batch(user_folder, capsys):
    status, out, err = lp_plan(capsys, *OWN, "strategy=pp", "strategy.micro_batches=2")
    assert status == 0, err
    assert "model: TinyLM" in out
    # ShuffledTokens yields 8 x 8 tokens: 2 micro-batches of 4 sequences, 64 tokens per step
    assert "batch: 2 micro-batch(es) of 4 sequences per replica, 64 tokens per optimizer step" in out
    assert "peak per device" in out


@pytest.mark.timeout(60)
def test_lp_plan_says_why_memory_is_not_estimated(user_folder, capsys):
    (user_folder / "my_pkg" / "broken.py").write_text(
        "from my_pkg import ShuffledTokens\n\nclass Broken(ShuffledTokens):\n"
        "    def setup(self, stage=None):\n        raise RuntimeError('data not downloaded yet')\n")
    status, out, err = lp_plan(capsys, *OWN[:3], "data._target_=my_pkg.broken.Broken")
    assert status == 0, err
    assert "memory per device: not estimated: Broken's training loader could not be read before the run " \
           "(RuntimeError: data not downloaded yet)" in out


# 3: strategy=auto with a data module of one's own, no batch-shape overrides
@pytest.mark.timeout(120)
def test_strategy_auto_trains_a_data_module_without_hyperparameters(user_folder):
    result = run(["lp-train", *OWN, "strategy=auto", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
                  "hydra.run.dir=auto"], user_folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "strategy=auto chose" in result.stdout + result.stderr
    # the search read the data module's first batch: 8 sequences per replica, 2 replicas
    assert re.search(r"chosen: tp=\d pp=\d dp=\d.* per step of (8|16) sequences", result.stdout + result.stderr)
    assert sorted(train_losses(user_folder / "auto")) == [0, 1]


# 4: lp-plan --search prints a command that trains with the layout as pasted
@pytest.mark.timeout(90)
def test_lp_plan_search_prints_a_command_that_passes_as_pasted(user_folder, capsys):
    status, out, err = lp_plan(capsys, "--search", *OWN, "--nodes", "1", "--devices-per-node", "2",
                               "--device-memory", "1", "--tflops", "1", "--intra-bandwidth", "1", "--latency-us", "10",
                               "--optimizer-rate", "100", "--global-batch", "16")
    assert status == 0, err
    (command,) = printed_commands(out.split("train with it:")[1])
    assert command[:6] == ["lp-train", "strategy=auto", *OWN]
    assert "+data.batch_size=8" in command  # the global batch of 16 over 2 replicas, added to a config without it
    plan = build_plan(compose_config(command[1:]), env={})
    assert plan.search is None  # every size pinned: the run does not search again


# 5: a fix that needs "+" gets it, and replaces the user's own override
@pytest.mark.timeout(90)
def test_suggested_fixes_carry_the_users_overrides_and_pass_as_pasted(user_folder, capsys):
    status, _, err = lp_plan(capsys, *OWN, "strategy=pp", "+data.batch_size=10")
    assert status == 1
    assert "the batch of 10 sequences (per replica) is not divisible by micro_batches=4" in err
    commands = printed_commands(err)
    assert ["lp-plan", *OWN, "strategy=pp", "+data.batch_size=8"] in commands
    for command in commands:
        assert command[1:5] == OWN
        assert_passes_launch_checks(command)


# 6: a class given to the default model config is answered with model=custom
@pytest.mark.timeout(90)
@pytest.mark.parametrize("group, target, other", [("model", "my_pkg.TinyLM", "+model.n_embd=32"),
                                                  ("data", "my_pkg.ShuffledTokens", "+data.seq=4")])
def test_own_class_without_the_custom_group_gets_the_right_line(user_folder, capsys, group, target, other):
    given = [f"{group}._target_={target}", other.lstrip("+")]
    if group == "data":
        given = [*OWN[:2], *given]
    status, _, err = lp_plan(capsys, *given)
    assert status == 2
    assert f"starts from the empty config {group}=custom" in err
    (command,) = printed_commands(err)
    assert f"{group}=custom" in command and other in command
    assert_passes_launch_checks(command)


# 7, 8: strategy=single reads the batches every layout reads; a quiet summary
@pytest.mark.timeout(150)
def test_single_reads_the_batches_in_the_order_of_the_layouts_and_prints_a_quiet_summary(user_folder):
    losses = {}
    for name, layout in {"single": ["strategy=single"], "dp1": ["strategy=dp", "trainer.devices=1"]}.items():
        result = run(["lp-train", *OWN, *layout, "trainer.max_steps=4", "trainer.log_every_n_steps=1",
                      f"hydra.run.dir={name}"], user_folder)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = train_losses(user_folder / name)
        output = result.stdout + result.stderr
        assert "Total params" in output
        for noise in ("FLOPs", "GPU available", "TPU available", "Trainer already configured"):
            assert noise not in output
    assert sorted(losses["single"]) == [0, 1, 2, 3]
    for step, loss in losses["single"].items():
        assert loss == pytest.approx(losses["dp1"][step], abs=LOSS_ATOL), losses


# 9: the strategy names under LightningCLI, from a script that does not import the package
LIGHTNING_CLI = '''
import sys
from lightning.pytorch.cli import LightningCLI
from my_pkg import ShuffledTokens, TinyLM

for name in sys.argv[1:]:
    cli = LightningCLI(TinyLM, ShuffledTokens, save_config_callback=None, args=[
        "fit", f"--trainer.strategy={name}", "--trainer.accelerator=cpu", "--trainer.devices=1",
        "--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"])
    print(name, type(cli.trainer.strategy).__name__, cli.trainer.global_step)
'''


@pytest.mark.timeout(120)
def test_strategy_names_work_under_lightning_cli_without_an_import(user_folder):
    installed = [Path(folder) / "lightning_parallel.pth" for folder in site.getsitepackages()]
    assert any(p.is_file() for p in installed), "reinstall the package (pip install -e .): no lightning_parallel.pth"
    (user_folder / "cli.py").write_text(LIGHTNING_CLI)
    names = {"lp_dp": "DataParallelStrategy", "lp_tp": "TensorParallelStrategy",
             "lp_pp": "PipelineParallelStrategy", "lp_3d": "ParallelStrategy"}
    result = run([sys.executable, "cli.py", *names], user_folder)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, strategy in names.items():
        assert f"{name} {strategy} 1" in result.stdout


# 10: a refusal in the words of a script, raised before any worker starts
SCRIPT = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning_parallel import ParallelStrategy
from my_pkg import Flat

if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    options = dict(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    try:
        L.Trainer(strategy=ParallelStrategy(pipeline_parallel=2, start_method="fork", timeout=30), **options).fit(Flat(), data)
    except ValueError as refused:
        print(refused)
    L.Trainer(strategy=ParallelStrategy(tensor_parallel=2, start_method="fork", timeout=30), **options).fit(Flat(), data)
'''


@pytest.mark.timeout(120)
def test_python_refusals_name_arguments_and_candidates_before_workers_start(user_folder):
    (user_folder / "train.py").write_text(SCRIPT)
    result = run([sys.executable, "train.py"], user_folder)
    assert result.returncode != 0
    # pipelining a model whose only list of blocks is not found by itself: the real candidate path
    assert "    ParallelStrategy(pipeline_blocks='net')\n" in result.stdout
    assert "    ParallelStrategy(pipeline_parallel=1)   # train without pipelining" in result.stdout
    # nothing to split: the refusal ends the output once, as the script's own arguments
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1] == "    ParallelStrategy(tensor_parallel=1)   # data parallelism only", "\n".join(lines[-15:])
    assert result.stderr.count("LaunchError: ") == 1
    assert "tensor parallelism has nothing to split in Flat" in result.stderr
    for absent in ("ProcessRaisedException", "Initializing distributed", "strategy.tensor_parallel"):
        assert absent not in result.stderr + result.stdout
