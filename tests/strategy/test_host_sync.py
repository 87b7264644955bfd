"""A training step reads the device from the host a small, fixed number of times.

On a GPU every ``.item()``, ``.tolist()``, ``.cpu()`` and ``bool(tensor)`` of a device tensor waits
for all queued kernels, so a read per batch (or per logged value) stalls every step. The tests count
these calls in every worker of a DP=2, TP=2 and PP=2 (two micro-batches) fit of the tiny GPT, from
the start of one batch to the start of the next, by the line that made them. On the CPU they are not
real device syncs, but the count is the one a GPU run makes.

Reads of tensors that live on the host on a GPU too are listed apart and not bounded (``HOST_ONLY``):
torch's optimizers read their ``step`` counters, which stay CPU tensors unless ``capturable`` or
``fused`` (one read per parameter), and tensor parallelism draws per-block seeds from the CPU
generator. The bounded reads, per rank and step (measured, and each one accounted for):

=====  =====  =====================================================================================
dp2    3      Lightning's 2 (below) + the gradient buckets' flags, one ``tolist`` for all buckets
tp2    2      Lightning's 2
pp2    5 / 7  Lightning's 2 + the tied embedding's has-a-gradient flag (1 tied parameter) + the
              end-of-step broadcast: its length prefix, and on stages other than the last its body;
              on the last stage instead its loss and its logged values (one copy each, however many
              keys and micro-batches) and, at the start of the step, the number of the loss's
              targets in each micro-batch (one copy for all micro-batches, ``pipeline/targets.py``)
=====  =====  =====================================================================================

Lightning's own two per step: the SIGTERM flag it broadcasts and reads before every batch of a
distributed run (``training_epoch_loop._broadcast_sigterm_tensor``), and the ``prog_bar`` value
(the GPT logs ``train_loss`` with ``prog_bar=True``) that it converts to a Python number each step.
The SLURM requeue check adds nothing between its checks (``requeue.CHECK_EVERY``; tested below).
"""

from __future__ import annotations

import collections
import os
import sys

import lightning as L
import pytest
import torch

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy.requeue import CHECK_EVERY, DeferredRequeue
from tests.helpers.parity import fit_and_record
from tests.helpers.processes import run_distributed
from tests.strategy.test_3d import token_data

# float() and int() are left out: in this code they convert tensors already copied to the host
READS = ("item", "tolist", "cpu", "__bool__")
HOST_ONLY = (os.path.join("torch", "optim", ""), os.path.join("lightning_parallel", "tensor_parallel", "random.py"))
BOUND = {"dp2": [3, 3], "tp2": [2, 2], "pp2": [5, 7]}  # per rank; see the table above
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTED_STEP = 2  # steps 0 and 1 include one-time work (first-call caches, optimizer state creation)


class HostReadCounter(L.Callback):
    """Patch the reads on ``torch.Tensor`` in this worker; count the calls of step ``COUNTED_STEP``."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.counts: collections.Counter = collections.Counter()
        self.counting = False
        self.originals = {}

    def setup(self, trainer, pl_module, stage):
        for name in READS:
            original = getattr(torch.Tensor, name)
            self.originals[name] = original
            setattr(torch.Tensor, name, self._counted(name, original))

    def _counted(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.counting:
                frame = sys._getframe(1)
                where = frame.f_code.co_filename
                if not where.startswith(TESTS_DIR):  # this test's own recorder is no part of the step
                    self.counts[(name, f"{where}:{frame.f_lineno}")] += 1
            return original(tensor, *args, **kwargs)
        return read

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == COUNTED_STEP:
            self.counting = True
        elif trainer.global_step == COUNTED_STEP + 1:
            self.counting = False
            torch.save(dict(self.counts), os.path.join(self.out_dir, f"reads{trainer.global_rank}.pt"))

    def teardown(self, trainer, pl_module, stage):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)


def count_reads(tmp_path, devices: int, **layout) -> list[dict]:
    L.seed_everything(0)
    module = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
    strategy = ParallelStrategy(start_method="fork", **layout)
    fit_and_record(module, token_data(), batch_size=4, out_dir=str(tmp_path), devices=devices, strategy=strategy,
                   max_steps=COUNTED_STEP + 2, callbacks=[HostReadCounter(str(tmp_path))])
    return [torch.load(str(tmp_path / f"reads{r}.pt")) for r in range(devices)]


def device_reads(counts: dict) -> dict:
    return {k: n for k, n in counts.items() if not any(part in k[1] for part in HOST_ONLY)}


LAYOUTS = {"dp2": dict(data_parallel=2), "tp2": dict(tensor_parallel=2),
           "pp2": dict(pipeline_parallel=2, micro_batches=2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_step_reads_device_a_fixed_few_times(tmp_path, name):
    per_rank = count_reads(tmp_path, 2, **LAYOUTS[name])
    for rank, counts in enumerate(per_rank):
        assert counts, "no read counted: the counter did not see the step"
        reads = device_reads(counts)
        listing = "\n".join(f"  {n} x {k[0]} at {k[1]}" for k, n in sorted(reads.items()))
        assert sum(reads.values()) <= BOUND[name][rank], f"rank {rank} reads the device too often:\n{listing}"


class FakeHandler:
    """Stands for Lightning's SLURM handler; records the batch at which it ran."""

    def __init__(self):
        self.batches: list[int] = []
        self.batch = 0

    def __call__(self, signum, frame):
        self.batches.append(self.batch)


def _requeue_worker(rank, world_size, signal_batch):
    import signal

    requeue = DeferredRequeue(None)
    requeue.signum, requeue.handler = signal.SIGUSR1, FakeHandler()
    collectives = []
    original = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: (collectives.append(requeue.handler.batch), original(*a, **k))[1]
    try:
        for batch in range(1, 3 * CHECK_EVERY + 1):
            requeue.handler.batch = batch
            if rank == 1 and batch == signal_batch:
                requeue._record(signal.SIGUSR1, None)  # what the installed handler does on the signal
            requeue.at_batch_boundary(torch.device("cpu"))
    finally:
        torch.distributed.all_reduce = original
    return requeue.handler.batches, collectives


def test_requeue_runs_on_every_rank_at_the_same_batch_with_one_collective_per_check():
    signal_batch = CHECK_EVERY + 3  # on rank 1 only
    results = run_distributed(_requeue_worker, 2, signal_batch)
    checks = [CHECK_EVERY * k for k in (1, 2, 3)]
    for handled, collectives in results:
        assert collectives == checks  # no collective (and no host read) between checks
        assert handled == [2 * CHECK_EVERY]  # the first check after the signal, on both ranks, once
