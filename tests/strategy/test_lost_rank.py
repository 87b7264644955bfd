"""A rank that dies mid-step or mid-save ends the others within seconds, naming it (``strategy/watchdog.py``).

Three fork-started processes see torchrun's variables and each runs its own Trainer (no launcher, no
parent that would terminate the others), the tiny GPT of ``test_checkpoint.py`` split into 3 pipeline
stages, with a process-group timeout of PG_TIMEOUT seconds and ``lost_rank_timeout=LOST``. Rank 1 is
then SIGKILLed inside a step (a forward hook), or SIGSTOPped there (a rank that stops answering without
closing its sockets, as a host that loses power: gloo then waits for the process-group timeout), or
SIGKILLed inside the background write of ``last.ckpt``. The other ranks must end within BOUND seconds
(far below PG_TIMEOUT; the watchdog needs LOST plus a heartbeat, the rest is slack for a loaded
machine) with a non-zero exit code and an error naming rank 1, and the checkpoint saved before stays
complete and loads.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_parallel import ParallelStrategy
from lightning_parallel.checkpoint import consolidate
from lightning_parallel.checkpoint.atomic import is_complete
from tests.checkpoint.test_checkpoint import HALF, STEPS, StepData, tiny_gpt
from tests.checkpoint.test_checkpoint_atomic import _killed, _last_piece, _strike_on
from tests.helpers.processes import start_ranks

WORLD, VICTIM, PG_TIMEOUT, LOST, BOUND = 3, 1, 300, 4.0, 30.0


class StopInsideStep(Callback):
    """On the victim, at step HALF, send ``signum`` to itself from inside the pipeline's forward."""

    def __init__(self, signum: int):
        self.signum = signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == VICTIM and trainer.global_step == HALF:
            def stop(module, args, output):
                os.kill(os.getpid(), self.signum)

            torch.nn.modules.module.register_module_forward_hook(stop)


def fit(root: Path, rank: int, callbacks: list, **strategy_args) -> None:
    strategy = ParallelStrategy(pipeline_parallel=WORLD, micro_batches=2, timeout=PG_TIMEOUT, lost_rank_timeout=LOST,
                                **strategy_args)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=callbacks, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        default_root_dir=str(root))
    trainer.fit(tiny_gpt(n_layer=3), datamodule=StepData())


def others_end_naming_the_victim(procs: list, logs: Path) -> None:
    """Every rank but the victim ends within BOUND seconds of the victim's end, non-zero, naming it."""
    victim = procs[VICTIM]
    deadline = time.monotonic() + 120
    while victim.exitcode is None and time.monotonic() < deadline:
        log = (logs / f"rank{VICTIM}.log")
        if log.exists() and "stopped" in log.read_text():  # a stopped process has no exit code yet
            break
        time.sleep(0.1)
    lost_at = time.monotonic()
    try:
        for rank, p in enumerate(procs):
            if rank != VICTIM:
                p.join(timeout=max(0.0, lost_at + BOUND - time.monotonic()))
        ended = {rank: p.exitcode for rank, p in enumerate(procs) if rank != VICTIM}
        took = time.monotonic() - lost_at
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert all(code is not None for code in ended.values()), f"still running {BOUND} s after rank {VICTIM} was lost"
    assert all(code != 0 for code in ended.values()), ended
    for rank in ended:
        text = (logs / f"rank{rank}.log").read_text()
        assert f"rank {VICTIM} is lost" in text, text[-3000:]
    print(f"the other ranks ended {took:.1f} s after rank {VICTIM} was lost")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_rank_lost_mid_step_ends_the_others_naming_it(tmp_path, signum):
    def run(rank):
        if rank == VICTIM and signum == signal.SIGSTOP:
            (tmp_path / "logs" / f"rank{rank}.log").open("a").write("")
        fit(tmp_path, rank, [StopInsideStep(signum), _MarkStopped(signum)])

    others_end_naming_the_victim(start_ranks(run, WORLD, str(tmp_path / "logs")), tmp_path / "logs")


class _MarkStopped(Callback):
    """Writes "stopped" to the victim's log just before it stops itself (SIGSTOP leaves no exit code)."""

    def __init__(self, signum: int):
        self.signum = signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.signum == signal.SIGSTOP and trainer.global_rank == VICTIM and trainer.global_step == HALF:
            print("stopped", flush=True)


@pytest.mark.timeout(180)
def test_rank_killed_mid_save_ends_the_others_and_the_previous_checkpoint_loads(tmp_path):
    last = tmp_path / "ckpt" / "last.ckpt"

    def run(rank):
        torch.save = _strike_on(VICTIM, HALF + 1, _last_piece, _killed)  # this process only (forked)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=0, save_last=True)
        fit(tmp_path, rank, [checkpoint], async_checkpoint=True)

    others_end_naming_the_victim(start_ranks(run, WORLD, str(tmp_path / "logs")), tmp_path / "logs")
    assert is_complete(last)
    assert consolidate(last)["global_step"] == HALF
