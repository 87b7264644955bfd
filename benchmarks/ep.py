"""Expert parallelism beside tensor parallelism over the experts: bytes each device sends per step.

One Mixtral experts layer (``--experts`` experts of hidden ``--hidden``, intermediate ``--inter``, top-2
routing from a fixed router) runs a training step (forward and backward) on a global batch of
``--tokens`` tokens, on N fork-started gloo processes, two ways:

* **EP** (``expert_parallel/``, what ``ParallelStrategy(expert_parallel=N)`` installs): each rank holds
  ``experts / N`` whole experts and ``tokens / N`` of the tokens (its data-parallel share); tokens go to
  their experts' ranks and back: four all-to-alls per layer (dispatch and combine, forward and backward)
  plus the exchange of the token counts;
* **TP over the experts** (``tensor_parallel/moe.py``, style ``moe_experts``): every rank holds a
  ``1 / N`` slice of every expert and all ``tokens`` of the replica; one all-reduce of the output
  forward and one of the input's gradient backward.

Bytes are counted as each device sends them: an all-reduce of ``n`` bytes over ``k`` ranks as a ring,
``2 (k - 1) / k * n``; an all-to-all as the rows it sends to other ranks. Both move a batch of the same
global size, so the ratio is bytes per token. The step time (median of ``--repeats``) is printed beside
it; the processes share this machine's cores, so read it as a relative cost only.

    python benchmarks/ep.py [--sizes 2 4 --tokens 4096 --hidden 256 --inter 512 --experts 8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lightning_parallel.expert_parallel import parallelize_experts  # noqa: E402
from lightning_parallel.mesh import ParallelMesh  # noqa: E402
from lightning_parallel.tensor_parallel import parallelize  # noqa: E402
from tests.helpers.processes import run_distributed  # noqa: E402

K = 2


class Holder(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


def build(args) -> Holder:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    experts = MixtralExperts(MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter,
                                           num_local_experts=args.experts))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    return Holder(experts)


def batch(args):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    scores = torch.randn(args.tokens, args.experts, generator=g)
    weights, index = torch.softmax(scores, dim=-1).topk(K, dim=-1)
    return x, index, weights / weights.sum(-1, keepdim=True)


class SentBytes:
    """Counts what this process sends through ``dist.all_reduce`` and ``dist.all_to_all_single``."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self.counting = False
        self._all_reduce, self._all_to_all = dist.all_reduce, dist.all_to_all_single
        dist.all_reduce, dist.all_to_all_single = self.all_reduce, self.all_to_all_single

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        k = dist.get_world_size(group)
        if self.counting:
            self.bytes += 2 * (k - 1) / k * tensor.numel() * tensor.element_size()
        return self._all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if self.counting:
            k, me = dist.get_world_size(group), dist.get_rank(group)
            rows = input.shape[0] if input.dim() else 1
            row = input.numel() // max(rows, 1) * input.element_size()
            own = input_split_sizes[me] if input_split_sizes else rows // k
            self.bytes += (rows - own) * row
        return self._all_to_all(output, input, output_split_sizes=output_split_sizes,
                                input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def run(kind: str, rank: int, world: int, args) -> tuple[float, float]:
    counter = SentBytes()
    mesh = ParallelMesh(world, tensor_parallel=world if kind == "tp" else 1,
                        expert_parallel=world if kind == "ep" else 1).init_process_groups(rank)
    model = build(args)
    x, index, weights = batch(args)
    if kind == "ep":
        parallelize_experts(model, mesh.ep_group, world, rank)
        mine = slice(rank * args.tokens // world, (rank + 1) * args.tokens // world)
        x, index, weights = x[mine], index[mine], weights[mine]
    else:
        with contextlib.redirect_stdout(io.StringIO()):  # the plan's table
            parallelize(model, mesh, plan={"experts": "moe_experts"})
    x.requires_grad_(True)

    def step():
        model.zero_grad(set_to_none=True)
        model.experts(x, index, weights).square().mean().backward()

    step()  # warm-up
    counter.counting = True
    step()
    counter.counting = False
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return counter.bytes, statistics.median(times)


def _measure(rank: int, world: int, kind: str, args) -> tuple[float, float]:
    return run(kind, rank, world, args)


def launch(kind: str, world: int, args) -> tuple[float, float]:
    """(bytes sent per device, step seconds), the maximum over ranks, of ``kind`` on ``world`` processes."""
    results = run_distributed(_measure, world, kind, args, timeout=600)
    return max(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"one Mixtral experts layer: {args.experts} experts, top-{K}, hidden {args.hidden}, intermediate "
          f"{args.inter}, {args.tokens} tokens per step (float32)")
    print(f"{'N':>3} {'EP MB/device':>13} {'TP MB/device':>13} {'EP/TP bytes':>12} {'EP ms':>8} {'TP ms':>8}")
    for n in args.sizes:
        ep_bytes, ep_time = launch("ep", n, args)
        tp_bytes, tp_time = launch("tp", n, args)
        print(f"{n:>3} {ep_bytes / 1e6:>13.2f} {tp_bytes / 1e6:>13.2f} {ep_bytes / tp_bytes:>12.2f} "
              f"{ep_time * 1e3:>8.1f} {tp_time * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
