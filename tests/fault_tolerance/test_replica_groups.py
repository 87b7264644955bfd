"""Two replica groups (each its own launch with two data-parallel ranks) meet at ``lp-lighthouse``; one
is SIGKILLed midway and started again while the other trains on.

The promise: the survivor never stops (one process for the whole run, trained alone while the other
was gone), the restarted group copies the live state (it starts at the live step, not at 0, with no
checkpoint on disk) and both stop at ``max_steps`` with the same parameters, rank by rank.

Tolerance: none (``torch.equal``). After the copy both groups hold the same bits and apply the same
arithmetic: each gradient is averaged inside the group, then summed over the two groups (``a + b`` and
``b + a`` are the same float) and divided by the same count, and the optimizer steps identical states.
A group that kept its own values or missed a step would differ by the size of an AdamW step, ~lr.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import lightning as L
import pytest
import torch

from lightning_parallel.cli.lighthouse import main as lighthouse_main
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
from tests.helpers.parity import TensorDataset, fit_and_record
from tests.helpers.processes import free_port

pytest.importorskip("torchft")

MAX_STEPS, KILL_AT = 20, 3
ALONE_PAUSE_S = 0.5  # while a group trains alone it slows down, so the other has time to start again


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, lr=1e-2)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (512, 9), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class _Quorum(L.Callback):
    """Records each step's quorum size; rank 0 SIGKILLs its whole group at step ``kill_at``, and writes
    ``alone`` once its group has trained alone after that step."""

    def __init__(self, out_dir: str, kill_at: int | None):
        self.out_dir, self.kill_at, self.steps = out_dir, kill_at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        participants = trainer.strategy.replicas.participants
        self.steps.append((trainer.global_step, participants))
        if self.kill_at is not None and trainer.global_step >= self.kill_at and trainer.global_rank == 0:
            os.killpg(0, signal.SIGKILL)
        if participants < 2:
            if trainer.global_step > KILL_AT and trainer.global_rank == 0:
                open(os.path.join(self.out_dir, "alone"), "w").close()
            time.sleep(ALONE_PAUSE_S)

    def on_train_end(self, trainer, pl_module):
        torch.save(self.steps, os.path.join(self.out_dir, f"quorum{trainer.global_rank}.pt"))


def _group(group: int, lighthouse: str, out_dir: str, kill_at: int | None, layout: dict) -> None:
    """One replica group: its own session (killed as one), its own rendezvous port, two ranks."""
    os.setsid()
    os.environ["MASTER_PORT"] = str(free_port())
    torch.set_num_threads(1)
    strategy = ParallelStrategy(replica_groups=2, replica_group=group, lighthouse=lighthouse, start_method="fork",
                                **layout)
    fit_and_record(_model(), _data(), batch_size=4, out_dir=out_dir, devices=2, strategy=strategy,
                   max_steps=MAX_STEPS, callbacks=[_Quorum(out_dir, kill_at)])


def _fork(target, *args) -> mp.Process:
    process = mp.get_context("fork").Process(target=target, args=args)
    process.start()
    return process


def _start_group(group: int, lighthouse: str, out_dir, layout: dict, kill_at: int | None = None) -> mp.Process:
    return _fork(_group, group, lighthouse, str(out_dir), kill_at, layout)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(), dict(pipeline_parallel=2, micro_batches=2)], ids=["dp2", "pp2"])
def test_killed_group_rejoins_from_live_peer_and_both_finish_equal(tmp_path, layout):
    port = free_port()
    # `lp-lighthouse --port P`, forked (this process never starts torchft's runtime, so forks stay clean)
    lighthouse = _fork(lighthouse_main, ["--port", str(port), "--join-timeout-ms", "1000",
                                         "--heartbeat-timeout-ms", "2000"])
    address = f"http://localhost:{port}"
    survivor_dir, first_dir, second_dir = (tmp_path / name for name in ("survivor", "first", "second"))
    processes = []
    try:
        processes += [_start_group(0, address, survivor_dir, layout),
                      _start_group(1, address, first_dir, layout, kill_at=KILL_AT)]
        survivor, first = processes
        first.join(timeout=120)
        assert first.exitcode == -signal.SIGKILL, f"group 1 was to be killed at step {KILL_AT}: {first.exitcode}"
        deadline = time.monotonic() + 60
        while not (survivor_dir / "alone").exists() and survivor.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert survivor.is_alive(), "the surviving group stopped when the other died"
        assert (survivor_dir / "alone").exists(), "the surviving group did not train on alone"
        processes.append(_start_group(1, address, second_dir, layout))
        for process in (survivor, processes[2]):
            process.join(timeout=120)
            assert process.exitcode == 0, f"a replica group failed: exit code {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                os.killpg(process.pid, signal.SIGKILL)
        lighthouse.terminate()
        lighthouse.join(timeout=30)

    for rank in range(2):
        live = torch.load(survivor_dir / f"rank{rank}.pt")
        rejoined = torch.load(second_dir / f"rank{rank}.pt")
        assert live["global_step"] == rejoined["global_step"] == MAX_STEPS
        for name, value in live["params"].items():
            assert torch.equal(value, rejoined["params"][name]), f"rank {rank}: {name} differs between the groups"
        quorum = [n for _, n in torch.load(survivor_dir / f"quorum{rank}.pt")]
        alone = quorum.index(1, quorum.index(2))  # both trained, then the survivor alone ...
        assert 2 in quorum[alone:], f"the restarted group never rejoined: {quorum}"  # ... then both again
        first_step, _ = torch.load(second_dir / f"quorum{rank}.pt")[0]
        assert first_step > KILL_AT, f"the restarted group started at step {first_step}, not at the live step"
    assert not any(path.suffix == ".ckpt" for path in tmp_path.rglob("*"))
