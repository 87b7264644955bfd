"""How long training stops per checkpoint: written in the background (``async_checkpoint=True``) against
written before training goes on (the default), on a split model whose save takes seconds.

The unchanged default GPT (AdamW), large enough that a checkpoint is hundreds of megabytes, trains
``--steps`` steps on ``--pp`` pipeline stages x ``--tp`` TP ranks (fork-started, gloo), a
``ModelCheckpoint`` saving ``last.ckpt`` every ``--every`` steps. Every rank times each call of the
save from the training loop (``ModelCheckpoint._save_checkpoint``: what training waits for), and the
wait at the end of ``fit`` for the last write. Synchronously the save is the whole write (every rank's
pieces, fsync, the commit); in the background it is staging the tensors in host memory, plus waiting
for the previous write where it has not finished. Printed: the median over saves and ranks of the
time stopped per save, for both, median of ``--repeats`` runs, and their ratio.

Run: ``python benchmarks/checkpoint.py [--tp 1] [--pp 2] [--steps 8] [--every 2] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lightning_parallel import ParallelStrategy  # noqa: E402
from lightning_parallel.models.gpt import GPT  # noqa: E402

SEQ, VOCAB = 64, 8192


class TimedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that records how long each save keeps the training loop waiting."""

    def __init__(self, out: Path, **kwargs):
        super().__init__(**kwargs)
        self.out, self.stops, self.final_wait = out, [], 0.0

    def _save_checkpoint(self, trainer, filepath):
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.stops.append(time.perf_counter() - start)


class EndWait(Callback):
    """Times the wait for the write in flight at the end of ``fit`` and writes this rank's figures."""

    def __init__(self, timed: TimedCheckpoint):
        self.timed = timed

    def on_train_end(self, trainer, pl_module):
        start = time.perf_counter()
        trainer.strategy.wait_for_checkpoint()
        wait = time.perf_counter() - start
        record = {"stops": self.timed.stops, "end_wait": wait}
        (self.timed.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(args, background: bool, out: Path) -> dict:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=args.layers, n_head=8, n_embd=args.width)
    tokens = torch.randint(0, VOCAB, (args.steps * 2, SEQ + 1))
    data = DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=2)
    timed = TimedCheckpoint(out, dirpath=out / "ckpt", every_n_train_steps=args.every, save_top_k=0, save_last=True)
    strategy = ParallelStrategy(tensor_parallel=args.tp, pipeline_parallel=args.pp, micro_batches=2,
                                start_method="fork", async_checkpoint=background, verify_split=False)
    trainer = L.Trainer(accelerator="cpu", devices=args.tp * args.pp, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timed, EndWait(timed)], default_root_dir=str(out))
    start = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - start
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.tp * args.pp)]
    size = sum(f.stat().st_size for f in (out / "ckpt" / "last.ckpt").rglob("*") if f.is_file())
    return {"stop": statistics.median(s for r in ranks for s in r["stops"]),
            "end_wait": max(r["end_wait"] for r in ranks), "wall": wall, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for name in ("sync", "async"):  # alternated, so a change in the machine's load hits both
                results[name].append(run(args, name == "async", Path(root) / f"{name}{repeat}"))
    size = results["sync"][0]["bytes"] / 2**20
    print(f"GPT {args.layers} x {args.width}, TP{args.tp} x PP{args.pp}, checkpoint {size:.0f} MiB, "
          f"a save every {args.every} of {args.steps} steps, median of {args.repeats} runs")
    print(f"{'':8}{'stopped per save (s)':>22}{'wait at end of fit (s)':>24}{'fit wall (s)':>14}")
    median = {name: {key: statistics.median(r[key] for r in runs) for key in ("stop", "end_wait", "wall")}
              for name, runs in results.items()}
    for name, m in median.items():
        print(f"{name:8}{m['stop']:>22.3f}{m['end_wait']:>24.3f}{m['wall']:>14.1f}")
    print(f"async / sync, time stopped per save: {median['async']['stop'] / median['sync']['stop']:.3f}")


if __name__ == "__main__":
    main()
