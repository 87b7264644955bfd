"""ZeRO memory and speed per rank, at 1, 2, 4 and 8 ranks, beside Lightning's fully sharded data parallelism.

For each layout the unchanged default GPT (AdamW) trains a few steps; every rank measures
- its **model state**: the bytes of the storages holding its parameters, gradients (with the
  data-parallel buckets that hold them) and optimizer state, after the last step;
- its **peak** during one step: the largest sum of the bytes of live tensor storages from the start of
  the step's forward to the end of its optimizer step (``LiveBytes``: the storages of the model
  state, plus every storage an operation creates during the step, each counted until it is freed;
  a storage resized in place, as FSDP frees a gathered parameter, counts at its new size). On a CPU
  there is no allocator to ask; this counts what an allocator would have to hold, without its
  caching or fragmentation.
The largest rank's figures are printed, with their ratio to one rank's; the ``pp2`` rows split the
model into 2 pipeline stages of 4 micro-batches, where ZeRO-3 keeps a stage gathered through the
step (``FullySharded(keep_gathered=True)``); the ``hsdp2`` rows shard over runs of 2 replicas and
replicate across them (``zero_shard_size=2``: a rank holds what ZeRO over 2 ranks holds, whatever
the number of replicas). Then steps per second of
ZeRO-2 and ZeRO-3 on 2 ranks, on the GPT and on the ResNet-50-shaped module of ``tests/helpers/resnet.py``,
median of ``--repeats`` runs (timed after the measured step), with the processor time the two ranks
spent per step: on a machine shared with other work, steps per second vary from run to run by up to
2x, the processor time much less.

The peer, with the same wrap unit (each transformer block, each ResNet bottleneck, then the rest):
Lightning's ``FSDPStrategy`` (FSDP1, ``FULL_SHARD`` beside ZeRO-3, ``SHARD_GRAD_OP`` beside ZeRO-2)
where as many GPUs as ranks are visible; it refuses a CPU ("requires a GPU accelerator"), so on a
CPU the peer is Lightning's ``ModelParallelStrategy``, whose ``configure_model`` must apply torch's
``fully_shard`` (FSDP2) by hand (``reshard_after_forward`` True beside ZeRO-3, False beside ZeRO-2).

Each measurement runs in processes of its own (Lightning launches the ranks as ``torchrun`` would).
Run: ``python benchmarks/zero.py [--ranks 1 2 4 8] [--repeats 3] [--steps 8] [--layouts zero0 zero3 ...]``
(``--repeats 0``: memory only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lightning_parallel import ParallelStrategy  # noqa: E402
from lightning_parallel.data.text import TextDataModule  # noqa: E402
from lightning_parallel.mesh import local_part  # noqa: E402
from lightning_parallel.models.gpt import GPT, Block  # noqa: E402
from tests.helpers.resnet import Bottleneck, ResNet, image_data  # noqa: E402

MODELS = {"gpt": (GPT, Block), "resnet": (ResNet, Bottleneck)}
# name -> (our zero stage, or None for the peer; the peer's resharding after forward; pipeline stages;
# the replicas that shard the parameters under hybrid sharding, or None for all)
LAYOUTS = {"zero0": (0, None, 1, None), "zero1": (1, None, 1, None), "zero2": (2, None, 1, None),
           "zero3": (3, None, 1, None), "hsdp2 zero2": (2, None, 1, 2), "hsdp2 zero3": (3, None, 1, 2),
           "peer-grad-op": (None, False, 1, None), "peer-full-shard": (None, True, 1, None),
           "pp2 zero1": (1, None, 2, None), "pp2 zero3": (3, None, 2, None)}


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages, and their peak, while inside (see the module docstring)."""

    def __init__(self, tensors):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self._resize = torch.UntypedStorage.resize_
        for t in tensors:
            self._track(t.untyped_storage())

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self.live or storage.device.type == "meta":
            return
        self.live[key] = storage.nbytes()
        self._add(storage.nbytes())
        weakref.finalize(storage, self._free, key)

    def _add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __enter__(self):
        tracker, resize = self, self._resize

        def resize_(storage, size):
            out = resize(storage, size)
            if storage._cdata in tracker.live:
                tracker._add(storage.nbytes() - tracker.live[storage._cdata])
                tracker.live[storage._cdata] = storage.nbytes()
            else:
                tracker._track(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                self._track(t.untyped_storage())
        return out


def model_state(trainer) -> list[torch.Tensor]:
    """This rank's tensors of parameters, gradients, optimizer state and data-parallel buckets."""
    module = trainer.lightning_module
    tensors = [local_part(p) for p in module.parameters()]
    tensors += [local_part(p.grad) for p in module.parameters() if p.grad is not None]
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:  # ZeRO-1 steps on pieces of the parameters
            tensors += [local_part(p.grad) for p in group["params"] if p.grad is not None]
        tensors += [local_part(v) for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    sync = getattr(trainer.strategy, "grad_sync", None)
    for bucket in sync.buckets if sync is not None else ():
        tensors += [bucket.buffer] + ([bucket.shard] if bucket.shard is not None else [])
    return tensors


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


class Measure(L.Callback):
    """Peak bytes during step ``warmup``, steps per second after it, model state at the end."""

    def __init__(self, warmup: int, out_dir: str):
        self.warmup, self.out_dir, self.tracker, self.start, self.cpu = warmup, out_dir, None, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.tracker = LiveBytes(model_state(trainer) + list(pl_module.buffers()))
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.tracker is not None and self.start is None:
            self.tracker.__exit__(None, None, None)
            self.start, self.cpu = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer, pl_module):
        timed = trainer.global_step - self.warmup - 1
        result = {"state": storage_bytes(model_state(trainer)), "peak": self.tracker.peak,
                  "steps_per_s": timed / (time.perf_counter() - self.start) if timed > 0 else None,
                  "cpu_s": (time.process_time() - self.cpu) / timed if timed > 0 else None}
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)


def peer_module(model_cls, unit, reshard: bool):
    """``model_cls`` with the ``configure_model`` Lightning's ModelParallelStrategy asks for: FSDP2 on
    every ``unit`` module, then on the whole module."""

    class HandSharded(model_cls):
        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for module in [m for m in self.modules() if isinstance(m, unit)]:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(self, mesh=mesh)

    return HandSharded


def run_one(args) -> None:
    """One measurement; Lightning starts the other ranks by running this command again."""
    torch.set_num_threads(1)
    model_cls, unit = MODELS[args.model]
    stage, reshard, pp, shard = LAYOUTS[args.layout]
    cuda = torch.cuda.device_count() >= args.world
    if args.world == 1:
        strategy = "auto"
    elif stage is not None:
        strategy = ParallelStrategy(data_parallel=args.world // pp, pipeline_parallel=pp, zero_stage=stage,
                                    zero_shard_size=shard, micro_batches=4 if pp > 1 else None)
    elif cuda:
        strategy = FSDPStrategy(auto_wrap_policy={unit}, sharding_strategy="FULL_SHARD" if reshard else "SHARD_GRAD_OP")
    else:
        strategy = ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1)
        model_cls = peer_module(model_cls, unit, reshard)
    L.seed_everything(0, verbose=False)
    if args.model == "gpt":
        data = TextDataModule(batch_size=args.batch_size, block_size=64)
        data.setup("fit")
        loader = DataLoader(data.train_dataloader().dataset, batch_size=args.batch_size, shuffle=True)
    else:
        loader = DataLoader(image_data(n=1024, size=32), batch_size=args.batch_size, shuffle=True)
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=args.world, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[Measure(args.warmup, args.out)])
    trainer.fit(model_cls(), loader)


def measure(model: str, layout: str, world: int, steps: int, warmup: int, batch_size: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, os.path.abspath(__file__), "--run", "--model", model, "--layout", layout,
                   "--world", str(world), "--steps", str(steps), "--warmup", str(warmup),
                   "--batch-size", str(batch_size), "--out", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured one")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="memory rows to measure")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="zero3", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return run_one(args)
    peer = "FSDPStrategy (FSDP1)" if torch.cuda.device_count() >= max(args.ranks) else \
        "ModelParallelStrategy + fully_shard (FSDP2) in configure_model"
    start = time.perf_counter()
    one = max(measure("gpt", "zero0", 1, args.warmup + 1, args.warmup, args.batch_size),
              key=lambda r: r["peak"])
    params = sum(p.numel() for p in GPT().parameters())
    print(f"\nGPT {params / 1e6:.2f}M parameters, AdamW, batch {args.batch_size} x 64 tokens per rank; peer: {peer}")
    print(f"one rank: model state {one['state'] / 2**20:.2f} MiB, peak during a step {one['peak'] / 2**20:.2f} MiB")
    worlds = [w for w in args.ranks if w > 1]
    print("largest rank, MiB (x one rank's)\n" + f"{'layout':<16}"
          + "".join(f"{f'{w} ranks: state':>22}{'peak':>18}" for w in worlds))
    for layout in args.layouts:
        cells = []
        for world in worlds:
            _, _, pp, shard = LAYOUTS[layout]
            if pp * 2 > world or pp * (shard or 1) >= world:  # two replicas remain, two shard groups under HSDP
                cells.append(f"{'':>22}{'':>18}")
                continue
            ranks = measure("gpt", layout, world, args.warmup + 1, args.warmup, args.batch_size)
            state, peak = max(r["state"] for r in ranks), max(r["peak"] for r in ranks)
            cells.append(f"{state / 2**20:>14.2f} ({state / one['state']:.2f}){peak / 2**20:>11.2f} ({peak / one['peak']:.2f})")
        print(f"{layout:<16}" + "".join(cells), flush=True)
    if not args.repeats:
        return
    print(f"\n2 ranks, median of {args.repeats} runs of {args.steps - args.warmup - 1} timed steps: steps/s, and "
          "processor ms per step (both ranks)")
    pairs = (("zero2", "peer-grad-op"), ("zero3", "peer-full-shard"))
    for model in MODELS:
        runs = {layout: [] for pair in pairs for layout in pair}
        for _ in range(args.repeats):  # interleaved, so that drift hits every layout alike
            for layout in runs:
                runs[layout].append(measure(model, layout, 2, args.steps, args.warmup, args.batch_size))
        rate = {k: statistics.median(r[0]["steps_per_s"] for r in v) for k, v in runs.items()}
        cpu = {k: statistics.median(sum(x["cpu_s"] for x in r) * 1e3 for r in v) for k, v in runs.items()}
        print(f"{model:<8}" + "   ".join(
            f"{ours} {rate[ours]:.2f} vs {rate[peer]:.2f} steps/s ({rate[ours] / rate[peer]:.2f}x), "
            f"{cpu[ours]:.0f} vs {cpu[peer]:.0f} ms ({cpu[peer] / cpu[ours]:.2f}x)" for ours, peer in pairs))
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
