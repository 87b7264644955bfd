"""Memory per device of a planned layout, computed from a model built on the meta device.

For each pipeline rank: the parameters it holds (its stages' blocks, plus the embedding on the
first and the head on the last; the weights the TP plan shards and the biases of column-parallel
layers divided by ``tp``, other vectors kept whole), their gradients, AdamW's two moment tensors,
and the activations that the pipeline schedule keeps alive: per block, the bytes the model's profile
(``profile.py``) says it saves for the backward, measured in a traced step (tensors as wide as the
hidden state whole on every TP rank, the rest divided by ``tp``, all of it with sequence parallelism),
plus what the modules before the blocks save on the first stage and the head and loss on the last.
For a model that names its sizes the profile follows Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, Table 2), in
bytes for 16-bit activations::

    no sequence parallelism:  s*b*h * (10 + 24/t + 5*a*s/(h*t))
    sequence parallelism:     s*b*h/t * (34 + 5*a*s/h)

scaled by ``activation bytes / 2`` for other precisions. With activation checkpointing of every
layer (``recompute``) a layer keeps only its input, ``s*b*h`` elements (``/t`` with sequence
parallelism), and one layer's full activations exist again while its backward runs (Korthikanti
et al. 2022, §4). ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054; ``zero_stage`` over ``dp``
replicas) divides the optimizer state by ``dp`` from stage 1 on; at stage 1 each rank also keeps the
``1/dp`` slice its gradient buckets are reduce-scattered to (``data_parallel/grad_sync.py``). From stage 2 on each rank keeps
``1/dp`` of the parameters and gradients, and holds whole what a step gathers
(``data_parallel/fully_sharded.py``), in the precision it computes in (bfloat16 under
``bf16-mixed``): at stage 2 every parameter, with one block's whole gradients at a time; at stage 3
the parameters outside the blocks and two blocks (the one computing and the one gathered next),
with one block's whole gradients. Hybrid sharding (``zero_shard_size=N``) shards over runs of ``N``
replicas instead: each rank keeps ``1/N`` of the parameters, gradients and optimizer state, the runs
holding the same rows. Under pipeline parallelism stages 2 and 3 keep the stage's
parameters and gradients whole through the step (ZeRO-1's peak, plus the shards). A rank keeps as many micro-batches in
flight as the schedule simulator counts (``min(P - r, M)`` for 1F1B, ``M`` for GPipe). The last
stage also holds the logits and their gradient in float32 (``8*s*b*V/t`` bytes from named sizes; traced:
what the head and loss save plus the gradient of the largest, divided by ``t`` where the plan shards the head). Context
parallelism (``context_parallel=c``) gives each rank ``s/c`` of the queries against all ``s`` keys,
so every term of a layer's activations, the ``s^2`` one included, is divided by ``c``; the logits are
not, since the head runs on the whole gathered sequence on every CP rank (``context_parallel/``). The named
sizes' formula assumes a GPT-style block (4h MLP, as many KV heads as heads). Nothing here counts
framework buffers or allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.pipeline.schedules import all_ranks, simulate
from lightning_parallel.tensor_parallel.moe import expert_layout
from lightning_parallel.tensor_parallel.shapes import find_fused_attention

# bytes per element: parameter, gradient, AdamW state (two tensors), activation
_PRECISION_BYTES = {
    "32-true": (4, 4, 8, 4),
    "bf16-mixed": (4, 4, 8, 2),
    "16-mixed": (4, 4, 8, 2),
    "bf16-true": (2, 2, 4, 2),
    "16-true": (2, 2, 4, 2),
}
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}


def precision_bytes(precision) -> tuple[int, int, int, int]:
    """(parameter, gradient, optimizer state, activation) bytes per element for a Trainer precision."""
    key = _PRECISION_ALIASES.get(str(precision), str(precision))
    if key not in _PRECISION_BYTES:
        raise ValueError(f"no memory estimate for precision={precision!r}; known: {', '.join(_PRECISION_BYTES)}")
    return _PRECISION_BYTES[key]


@dataclass(frozen=True)
class TransformerDims:
    """The sizes the activation formula needs, read from the model."""

    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None  # grouped-query attention's key/value heads; None: as many as heads

    @property
    def kv_hidden(self) -> int:
        """Width of the keys (and of the values) of one token."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads


def transformer_dims(model: nn.Module) -> TransformerDims | None:
    """Hidden size, heads (and key/value heads) and vocabulary of a Hugging Face config inside ``model``,
    or of nanoGPT-style hyperparameters (``n_embd``, ``n_head``, ``vocab_size``); None when neither is there."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if all(hasattr(config, k) for k in ("hidden_size", "num_attention_heads", "vocab_size")):
            return TransformerDims(config.hidden_size, config.num_attention_heads, config.vocab_size,
                                   getattr(config, "num_key_value_heads", None))
    hp = getattr(model, "hparams", {})
    if all(k in hp for k in ("n_embd", "n_head", "vocab_size")):
        return TransformerDims(hp["n_embd"], hp["n_head"], hp["vocab_size"])
    return None


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def layer_activation_bytes(
    dims: TransformerDims, seq: int, micro_batch: int, tp: int, sequence_parallel: bool, act_bytes: int
) -> float:
    """Korthikanti et al. 2022, Table 2: activations one transformer layer stores for backward."""
    s, b, h, a, t = seq, micro_batch, dims.hidden, dims.heads, tp
    if sequence_parallel:
        per_layer = s * b * h / t * (34 + 5 * a * s / h)
    else:
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return per_layer * act_bytes / 2


@dataclass(frozen=True)
class RankMemory:
    """Estimated memory of one device of pipeline rank ``stage`` (all its TP/DP peers are alike)."""

    stage: int
    blocks: tuple[int, ...]
    params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    in_flight: int

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def parameters_per_rank(model: nn.Module, stages: StagePlan, tp_sharded: dict[int, int], tp: int) -> list[int]:
    """Parameter elements each pipeline rank holds on one device; ``tp_sharded`` are ids of
    parameters divided across the TP group."""
    held: list[dict[int, nn.Parameter]] = [{} for _ in range(stages.ranks)]
    owned: set[int] = set()
    for name, stage in stages.module_stages().items():
        for p in model.get_submodule(name).parameters():
            held[stages.rank_of_stage(stage)][id(p)] = p
            owned.add(id(p))
    for p in model.parameters():  # outside every partitioned module: kept on every rank
        if id(p) not in owned:
            for rank_params in held:
                rank_params[id(p)] = p
    return [sum(held_elements(p, tp_sharded, tp) for p in h.values()) for h in held]


def held_elements(p: nn.Parameter, tp_sharded, tp: int) -> int:
    """Elements of ``p`` one TP rank holds: its ``1 / tp`` when the plan shards it (``1 / heads`` for a
    key/value projection over ``heads < tp`` heads, whose copies several ranks hold), else all of them."""
    if id(p) not in tp_sharded:
        return p.numel()
    heads = tp_sharded[id(p)] if isinstance(tp_sharded, dict) else 0
    return -(-p.numel() // (min(tp, heads) if heads else tp))


def tp_sharded_parameters(assignments) -> dict[int, int]:
    """Ids of the parameters a TP plan's assignments shard, as ``tensor_parallel/apply.py`` shards them:
    a colwise layer's weight and bias, a rowwise layer's weight, an embedding's rows, a whole attention's
    projections but its output bias, every expert's weights, the ``params`` of ``local_params`` and
    ``all_reduce`` modules. Works on a model built on the meta device. Each id maps to the heads of a
    colwise entry that states them (``PlanEntry.heads``, copied past that many TP ranks), else 0."""
    ids: dict[int, int] = {}
    for a in assignments:
        m, style = a.module, a.entry.style
        if style == "colwise":
            names = ["weight", "bias"]
        elif style in ("rowwise", "vocab"):
            names = ["weight"]
        elif style == "attention":
            out = "out_proj" if isinstance(m, nn.MultiheadAttention) else find_fused_attention(m).out
            names = [n for n, _ in m.named_parameters() if n != f"{out}.bias"]
        elif style == "moe_experts":
            names = list(expert_layout(m))
        elif style in ("local_params", "all_reduce"):
            names = [n for n, _ in a.entry.params]
        else:
            names = []
        params = dict(m.named_parameters())
        ids.update({id(params[n]): a.entry.heads for n in names if params.get(n) is not None})
    return ids


def estimate_memory(
    model: nn.Module,
    stages: StagePlan,
    tp_sharded: dict[int, int],
    tp: int,
    seq: int,
    micro_batch: int,
    micro_batches: int,
    schedule: str,
    sequence_parallel: bool,
    precision,
    zero_stage: int = 0,
    dp: int = 1,
    recompute: bool = False,
    params: list[int] | None = None,
    in_flight: list[int] | None = None,
    context_parallel: int = 1,
    zero_shard_size: int | None = None,
    profile=None,
) -> list[RankMemory]:
    """Memory per device of every pipeline rank (see the module docstring for what is counted).

    ``params`` (``parameters_per_rank``) and ``in_flight`` (the simulator's peak micro-batches per
    rank) may be given by a caller that estimates many layouts of one split. ``zero_shard_size``: the
    replicas ZeRO-2/3 shard over (HSDP), None for all ``dp`` of them. ``profile``: the model's costs per
    sample (``profile.model_profile``; by default from its named sizes or parameters alone).
    """
    p_bytes, g_bytes, o_bytes, a_bytes = precision_bytes(precision)
    if params is None:
        params = parameters_per_rank(model, stages, tp_sharded, tp)
    pp, virtual = stages.ranks, stages.num_stages // stages.ranks
    if in_flight is None:
        in_flight = [1] if pp == 1 else simulate(all_ranks(schedule, pp, micro_batches, virtual)).peak_in_flight
    if profile is None:
        from lightning_parallel.planner.profile import model_profile

        profile = model_profile(model, seq)
    scale = profile.scale(a_bytes) * micro_batch / context_parallel
    head_sharded = any(id(p) in tp_sharded for n in stages.post for p in model.get_submodule(n).parameters())
    shards = zero_shard_size if zero_stage >= 2 and zero_shard_size else dp  # the replicas ZeRO-2/3 shard over
    optimizer_shards = shards if zero_stage else 1
    result = []
    for rank in range(pp):
        rank_stages = stages.stages_of_rank(rank)
        blocks = tuple(i for s in rank_stages for i in stages.stage_blocks[s])
        # each in-flight unit is one (virtual) stage's blocks for one micro-batch
        saved = [[profile.blocks[i].saved_bytes(tp, sequence_parallel) * scale for i in stages.stage_blocks[s]]
                 for s in rank_stages]
        if recompute:  # a block keeps its input; one block's activations exist again during its backward
            layer_input = profile.boundary * profile.element_bytes * scale / (tp if sequence_parallel else 1)
            deepest = max(len(b) for b in saved)
            act = in_flight[rank] * deepest * layer_input + max((x for b in saved for x in b), default=0.0)
        else:
            act = in_flight[rank] * max(sum(b) for b in saved)
        if rank == stages.rank_of_stage(0):  # the modules before the blocks, on the whole sequence, per micro-batch
            act += in_flight[rank] * profile.pre_bytes * profile.scale(a_bytes) * micro_batch
        if rank == stages.rank_of_stage(stages.num_stages - 1):
            # the logits and their gradient, in float32 whatever the precision; the whole sequence under CP
            act += profile.post_bytes * micro_batch / (tp if head_sharded or profile.source == "named" else 1)
        n = params[rank]
        param_bytes, grad_bytes = _zero_peak(n, _block_elements(model, stages, blocks, tp_sharded, tp), zero_stage,
                                             shards, pp > 1, p_bytes, g_bytes, min(p_bytes, a_bytes))
        result.append(RankMemory(rank, blocks, n, param_bytes, grad_bytes, n * o_bytes / optimizer_shards,
                                 act, in_flight[rank]))
    return result


def _block_elements(model: nn.Module, stages: StagePlan, blocks: tuple[int, ...], tp_sharded: dict[int, int],
                    tp: int) -> list[int]:
    """Parameter elements of each of ``blocks`` on one device (TP-sharded weights divided by ``tp``)."""
    layers = model.get_submodule(stages.blocks_path)
    return [sum(held_elements(p, tp_sharded, tp) for p in layers[i].parameters()) for i in blocks]


def _zero_peak(n: int, blocks: list[int], stage: int, dp: int, pipelined: bool, p_bytes: int, g_bytes: int,
               gathered_bytes: int) -> tuple[float, float]:
    """Parameter and gradient bytes at a step's peak of a device holding ``n`` elements, ``blocks`` of them
    in its blocks, at ZeRO ``stage`` over ``dp`` replicas: its shards, and what the step gathers."""
    if stage == 1 and dp > 1:  # the bucket each gradient is a view into, and the slice it is reduce-scattered to
        return n * p_bytes, n * g_bytes * (1 + 1 / dp)
    if stage < 2 or dp == 1:
        return n * p_bytes, n * g_bytes
    if pipelined:  # gathered once per step and kept, gradients accumulated whole
        return n / dp * p_bytes + n * gathered_bytes, n * g_bytes
    largest = max(blocks, default=0)
    gathered = n if stage == 2 else n - sum(blocks) + 2 * largest
    return n / dp * p_bytes + gathered * gathered_bytes, (n / dp + largest) * g_bytes
