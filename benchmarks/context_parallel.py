"""Context parallelism: activation memory per rank at 4k to 16k tokens, ring against all-gathered keys,
and torch's experimental ``context_parallel``.

A small Hugging Face Llama (``--layers`` blocks of hidden 256, 8 heads of 32, 2 KV heads, MLP 704,
vocabulary 512, ``sdpa`` attention) runs one training step (forward and backward) on one sequence of
each length, on one process (CP1) and split over 2 and 4 gloo processes (``ContextParallel``, the
hooks ``ParallelStrategy(context_parallel=N)`` installs). Per rank it reports:

* activation memory: the bytes autograd saves for backward during the forward (distinct storages,
  parameters excluded, counted with ``torch.autograd.graph.saved_tensors_hooks``), for the blocks
  alone and in total. The total includes what runs on the whole sequence on every rank: the
  embedding's output, the final norm, the head's logits and the loss. Exact and device independent,
  unlike a CPU process's resident set;
* the step time, median of ``--repeats`` (the ranks share this machine's cores, so CP ranks run
  side by side on fewer cores each: read it as the cost of the ring's extra work and waiting, not
  as a speed-up).

``--compare`` runs the same split with keys and values all-gathered instead of passed round the
ring (each rank gathers the whole sequence's keys and values, then attends its two chunks to the
keys before them with one ``scaled_dot_product_attention`` call each, Llama 3's choice, Dubey et al.
2024 §3.3.2), to decide which exchange to use at these sizes. It also tries torch's experimental
``torch.distributed.tensor.experimental.context_parallel`` on the same CPU ranks.

``--padding F`` pads the last fraction ``F`` of the sequence (``attention_mask`` 0 there, labels -100),
so the ring rebuilds each block's part of the padding mask; the losses at every CP size must then
equal CP1's, and the step times and memory beside an unpadded run's show what the mask costs.

    python benchmarks/context_parallel.py [--lengths 4096 8192 16384 --sizes 1 2 4 --layers 4 --compare]
    python benchmarks/context_parallel.py --lengths 4096 --padding 0.25
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import socket
import statistics
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from lightning_parallel.context_parallel import attention as cp_attention
from lightning_parallel.context_parallel.chunks import chunks_of, unshard
from lightning_parallel.context_parallel.sequence import ContextParallel

MiB = 2**20


def build(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=layers, vocab_size=512, max_position_embeddings=65536, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


class SavedBytes:
    """Bytes of the distinct non-parameter storages autograd saves, in total and while ``inside`` is set."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.total = self.blocks = 0
        self.inside = False

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.total += storage.nbytes()
            self.blocks += storage.nbytes() if self.inside else 0
        return tensor


# the autograd-aware all-gather; its deprecation points to a private replacement
warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)


def allgather_attention(q, k, v, causal, scale, ring, fused=None, ids=None):
    """The all-gather alternative to ``ring_attention``: the whole sequence's keys and values on every
    rank (gradients reduce-scattered back by the collective's backward), each local chunk attending
    to the keys up to its end. Unmasked sequences only (``ids`` None): the benchmark has no padding."""
    assert ids is None, "the all-gather exchange is measured on unpadded sequences"
    k_all = unshard(list(dist_fn.all_gather(k.contiguous(), group=ring.group)), 2)
    v_all = unshard(list(dist_fn.all_gather(v.contiguous(), group=ring.group)), 2)
    size = q.shape[2] // 2
    outs = []
    for half, chunk in zip(q.split(size, 2), chunks_of(ring.rank, ring.size)):
        end = (chunk + 1) * size if causal else k_all.shape[2]
        # the causal mask of these queries (the last ``size`` positions before ``end``) on keys 0 .. end
        mask = torch.ones(size, end, dtype=torch.bool).tril(end - size) if causal else None
        outs.append(cp_attention._SDPA(half, k_all[:, :, :end], v_all[:, :, :end], attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(outs, 2)


def measure(rank: int, world: int, length: int, layers: int, repeats: int, exchange: str, padding: float = 0.0
            ) -> dict:
    model = build(layers)
    blocks = model.model.layers
    context = ContextParallel(blocks, dist.group.WORLD) if world > 1 else None
    if exchange == "allgather":
        cp_attention.ring_attention = allgather_attention
    tokens = torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=tokens, labels=tokens)
    if padding:
        mask = torch.ones_like(tokens)
        mask[:, length - int(padding * length):] = 0
        inputs.update(attention_mask=mask, labels=tokens.masked_fill(mask == 0, -100))
    counter = SavedBytes(model.parameters())
    blocks[0].register_forward_pre_hook(lambda *a: setattr(counter, "inside", True))
    blocks[-1].register_forward_hook(lambda *a: setattr(counter, "inside", False))
    times = []
    for repeat in range(repeats):
        start = time.perf_counter()
        with context.active() if context is not None else open(os.devnull):
            if repeat == 0:
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                    loss = model(**inputs).loss
            else:
                loss = model(**inputs).loss
            loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"blocks": counter.blocks, "total": counter.total, "time": statistics.median(times[1:] or times),
            "loss": loss.item()}


def torch_experimental(rank: int, world: int) -> str:
    """What torch's experimental ``context_parallel`` does with causal attention on these CPU ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 8, 64, 32) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as err:  # noqa: BLE001 - the outcome is the measurement
        return f"{type(err).__name__}: {err}"
    return "ran"


def _worker(rank, world, port, fn, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
        result = fn(rank, world, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, buffer.getvalue()))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc()))


def run(world: int, fn, *args) -> list:
    if world == 1:
        torch.set_num_threads(os.cpu_count() or 1)
        return [fn(0, 1, *args)]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join()
    failed = [text for text in results.values() if isinstance(text, str)]
    if failed:
        raise RuntimeError(failed[0])
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare", action="store_true", help="also all-gathered keys and torch's context_parallel")
    parser.add_argument("--padding", type=float, default=0.0, help="fraction of each sequence padded on the right")
    args = parser.parse_args()
    started = time.perf_counter()
    exchanges = ("ring", "allgather") if args.compare else ("ring",)
    print(f"Llama, {args.layers} blocks, hidden 256, batch 1, {args.padding:.0%} padding; activation memory per rank "
          "(MiB) saved for backward", flush=True)
    print(f"{'tokens':>7} {'cp':>3} {'exchange':>9} {'blocks':>8} {'total':>8} {'blocks x cp':>11} {'step s':>7} "
          f"{'loss':>8}")
    for length in args.lengths:
        base = None
        for cp in args.sizes:
            for exchange in exchanges if cp > 1 else ("-",):
                r = run(cp, measure, length, args.layers, args.repeats, exchange, args.padding)
                worst = max(r, key=lambda x: x["total"])
                base = base or worst
                print(f"{length:>7} {cp:>3} {exchange:>9} {worst['blocks'] / MiB:>8.1f} {worst['total'] / MiB:>8.1f} "
                      f"{worst['blocks'] * cp / base['blocks']:>11.2f} {max(x['time'] for x in r):>7.2f} "
                      f"{worst['loss']:>8.5f}", flush=True)
    if args.compare:
        outcome = run(2, torch_experimental)[0]
        print(f"torch.distributed.tensor.experimental.context_parallel on 2 CPU ranks: {outcome}")
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
