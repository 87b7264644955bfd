"""Predicted time of one training step of a layout: compute, TP and PP traffic, the bubble, DP.

Per micro-batch and stage, compute is the stage's forward FLOPs over the calibrated rate, divided
by the TP size: the FLOPs of its blocks (and of the embedding and head on the first and last stage)
as the model's profile gives them (``profile.py``: counted in a traced step, or for a model naming
its sizes ``2`` FLOPs per weight of every linear layer and token plus ``4 s h`` per token and layer
for the attention scores and their weighted sum, Narayanan et al. 2021, arXiv 2104.04473 §5.1). The
activation that TP all-reduces and stages send is the hidden state between two blocks, as traced.
A backward costs twice the forward: one input-gradient and one weight-gradient pass of a forward's
FLOPs each, which schedules with a separate ``W`` action run apart. Activation checkpointing adds one
forward to the input-gradient pass.

Collectives are rings: an all-reduce of ``n`` bytes over ``k`` devices moves ``2 (k - 1) / k * n``
bytes through each device and takes ``2 (k - 1)`` message latencies. Tensor parallelism all-reduces
the ``s b h`` activations twice per layer forward and twice backward (Shoeybi et al. 2019, arXiv
1909.08053 §3), inside a node, plus once for a vocabulary-parallel embedding and once, with three
token-sized reductions, for a vocabulary-parallel head and loss. Pipeline stages send one activation forward and its gradient back
per micro-batch, across nodes where neighbouring stages sit on different nodes. The per-stage
costs of the slowest stage (it sets the pace of the pipeline) go to the schedule simulator
(``pipeline.schedules.simulate``), which adds the bubble. Context parallelism (``cp`` ranks per
sequence) divides the blocks' compute and activations by ``cp`` but not the embedding's and head's,
which run on the whole sequence on every CP rank; its ring moves each layer's keys and values
``cp - 1`` times forward, and again with their float32 gradients (``cp`` times) backward, plus one
all-gather of the last block's output, charged without overlap with compute (an upper bound; ring
attention overlaps them). Expert parallelism adds four all-to-alls per MoE layer and micro-batch
(``experts.py``), not overlapped either. The data-parallel gradient all-reduce over the DP and CP ranks (with ZeRO
a reduce-scatter and all-gathers: the same bytes at stages 1 and 2, 1.5x at stage 3 without
pipelining, which gathers every block twice) follows the pipeline flush with no overlap credited,
which is exact for a contended CPU and an upper bound on a GPU. Under hybrid sharding (``zero_shard``
replicas per shard group) those collectives run inside the shard group, and the shard's gradients
(``1 / zero_shard`` of them) are all-reduced across the groups. The optimizer step updates the
parameters a device holds (a ``1 / (DP x CP)`` share under ZeRO, ``1 / zero_shard`` under hybrid
sharding) at the calibrated AdamW rate. When the
devices are processes sharing CPU cores (``Cluster.shared_compute``) a waiting rank's core runs
another rank, so the step is a rank's work (stages at their mean cost) and the bubble costs no time.
Not modelled: framework overheads per micro-batch, slower matmuls for small
micro-batches (instead the search caps the micro-batch count, ``space.MICRO_BATCHES_PER_STAGE``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline.partition import StagePlan
from lightning_parallel.pipeline.schedules import simulate
from lightning_parallel.planner.estimate import precision_bytes
from lightning_parallel.planner.experts import all_to_all_bytes, routed_layers, top_k
from lightning_parallel.planner.profile import ModelProfile
from lightning_parallel.planner.space import Candidate, Cluster, actions_of

# the data-parallel synchroniser's default bucket: one ring of latencies per bucket
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Prediction:
    """One step of a layout on the busiest device; times in seconds."""

    step_time: float
    compute: float  # forward and backward matmuls
    tensor_parallel: float  # TP all-reduces
    point_to_point: float  # activations and their gradients between stages
    context_parallel: float  # the ring's keys and values, forward and backward, and the gather after the blocks
    bubble: float  # the pipeline's idle share of the step, as a fraction
    data_parallel: float  # gradient all-reduce after the flush
    optimizer: float  # the optimizer step on the parameters this device updates
    bytes_moved: float  # bytes each device sends per step (all collectives and sends)
    expert_parallel: float = 0.0  # the all-to-alls that send tokens to their experts' ranks and back

    @property
    def idle(self) -> float:
        busy = (self.compute + self.tensor_parallel + self.point_to_point + self.context_parallel
                + self.data_parallel + self.optimizer + self.expert_parallel)
        return self.step_time - busy


def ring_allreduce(nbytes: float, devices: int, bandwidth: float, latency: float) -> tuple[float, float]:
    """(seconds, bytes through each device) of a ring all-reduce of ``nbytes``."""
    if devices == 1:
        return 0.0, 0.0
    through = 2 * (devices - 1) / devices * nbytes
    return through / bandwidth + 2 * (devices - 1) * latency, through


def _has(model: nn.Module, names: tuple[str, ...], kind: type, vocab: int) -> bool:
    """Whether one of the modules ``names`` holds a ``kind`` layer with a vocabulary-sized dimension."""
    return any(isinstance(m, kind) and vocab in m.weight.shape for n in names for m in model.get_submodule(n).modules())


@dataclass(frozen=True)
class StageWork:
    """What one micro-batch asks of each (virtual) stage of a split, unsplit by TP."""

    flops_per_sample: list[float]  # forward FLOPs of one sample
    outer_flops_per_sample: list[float]  # the part of them outside the blocks (embedding, head), on the whole sequence
    layers: list[int]  # blocks of each stage
    forward_allreduces: list[int]  # activation-sized all-reduces under TP, forward
    backward_allreduces: list[int]  # the same, backward
    loss_allreduces: list[int]  # token-sized ones (vocabulary-parallel cross entropy)
    moe_layers: tuple[int, ...] = ()  # MoE layers of each stage (expert parallelism's all-to-alls)
    top_k: int = 2  # experts per token


def stage_work(model: nn.Module, stages: StagePlan, profile: ModelProfile) -> StageWork:
    """Per (virtual) stage: forward FLOPs per sample (``profile``), and the TP all-reduces per micro-batch (two
    per layer each way; one forward for a vocabulary-parallel embedding on the first stage; one backward
    and three token-sized for a vocabulary-parallel head and loss on the last)."""
    blocks = model.get_submodule(stages.blocks_path)
    last = stages.num_stages - 1
    embedding = bool(profile.vocab) and _has(model, stages.pre, nn.Embedding, profile.vocab)
    head = bool(profile.vocab) and _has(model, stages.post, nn.Linear, profile.vocab)
    flops, outer, forward, backward, loss = [], [], [], [], []
    for s, block_range in enumerate(stages.stage_blocks):
        f = profile.block_flops(block_range)
        o = (profile.pre_flops if s == 0 else 0.0) + (profile.post_flops if s == last else 0.0)
        flops.append(f + o)
        outer.append(o)
        forward.append(2 * len(block_range) + int(s == 0 and embedding))
        backward.append(2 * len(block_range) + int(s == last and head))
        loss.append(3 if s == last and head else 0)
    moe = tuple(sum(routed_layers(blocks[i]) for i in r) for r in stages.stage_blocks)
    return StageWork(flops, outer, [len(r) for r in stages.stage_blocks], forward, backward, loss, moe,
                     top_k(model) if any(moe) else 2)


def _crosses_nodes(ranks: list[int], devices_per_node: int) -> bool:
    return len({r // devices_per_node for r in ranks}) > 1


def _bandwidth(ranks: list[int], cluster: Cluster) -> float:
    """The bandwidth of a collective over ``ranks``: across nodes when they span several."""
    across = _crosses_nodes(ranks, cluster.devices_per_node)
    return cluster.rates.inter_bandwidth if across else cluster.rates.intra_bandwidth


def predict(candidate: Candidate, work: StageWork, profile: ModelProfile, cluster: Cluster, seq: int,
            precision: str) -> Prediction:
    """The step time of ``candidate``, whose split asks ``work`` (``stage_work``) of its stages; see
    the module docstring for the model of it."""
    lay, rates = candidate.layout, cluster.rates
    p_bytes, g_bytes, _, a_bytes = precision_bytes(precision)
    samples = candidate.replica_batch // lay.micro_batches  # per micro-batch
    tokens = seq * samples
    cp = lay.cp
    mesh = ParallelMesh(cluster.world, tensor_parallel=lay.tp, pipeline_parallel=lay.pp, data_parallel=lay.dp,
                        context_parallel=cp, expert_parallel=lay.ep)
    # the stage that paces the pipeline: the slowest, or the mean one when cores are shared
    pace = (lambda xs: sum(xs) / len(xs)) if cluster.shared_compute else max

    # under CP the blocks see a 1/cp share of the tokens, the embedding and head all of them
    per_sample = [(f - o) / cp + o for f, o in zip(work.flops_per_sample, work.outer_flops_per_sample)]
    forward = pace(per_sample) * samples / lay.tp / rates.flops
    activation = samples * profile.boundary * a_bytes / cp  # the TP all-reduces of the blocks' share of the tokens
    one, through = ring_allreduce(activation, lay.tp, rates.intra_bandwidth, rates.latency)
    small = ring_allreduce(tokens * 4, lay.tp, rates.intra_bandwidth, rates.latency)[0]
    tp_forward = pace([n * one + k * small for n, k in zip(work.forward_allreduces, work.loss_allreduces)])
    tp_backward = pace(work.backward_allreduces) * one
    recompute = forward if lay.recompute else 0.0
    tp_recompute = tp_forward if lay.recompute else 0.0
    # point to point: one message each way per micro-batch and stage boundary
    across = _crosses_nodes(mesh.pp_groups()[0], cluster.devices_per_node)
    link = rates.inter_bandwidth if across else rates.intra_bandwidth
    p2p = (activation / link + rates.latency) if lay.pp > 1 else 0.0

    ring, ring_bytes = _context_parallel(tokens, profile, a_bytes, cp, pace(work.layers), mesh, cluster)
    experts, experts_bytes = _expert_parallel(tokens, profile, a_bytes, lay, work, mesh, cluster)

    f_cost = forward + tp_forward + p2p
    b_cost = forward + recompute + tp_backward + tp_recompute + p2p  # input gradient
    w_cost = forward  # weight gradient
    actions = actions_of(lay)
    per_rank = lay.micro_batches * lay.virtual_stages  # compute units of one rank per step
    if actions is None:
        pipeline_time, bubble = f_cost + b_cost + w_cost + ring + experts, 0.0
    else:
        # a B without its own W action (an unsplit backward) costs b_cost + w_cost there
        sim = simulate([list(a) for a in actions], forward_cost=f_cost, backward_cost=b_cost, weight_cost=w_cost)
        pipeline_time, bubble = sim.step_time, sim.bubble_fraction
        if cluster.shared_compute:  # the idle ranks' cores run the busy ones: only the work counts
            pipeline_time = per_rank * (f_cost + b_cost + w_cost)

    # data parallelism: every gradient this device holds, once per step. With ZeRO a reduce-scatter of
    # the gradients and an all-gather of the parameters each move half an all-reduce's bytes; ZeRO-2/3
    # gather in the precision they compute in, and ZeRO-3 without pipelining twice (for the forward and
    # again for the backward): 1.5x plain DP's bytes in float32
    held = max(m.params for m in candidate.memory)
    shards = lay.zero_shard or lay.dp * cp  # the ranks the gradients are reduce-scattered over under ZeRO
    dp_ranks = mesh.group_ranks("dp_cp", 0)
    gathered = min(p_bytes, a_bytes) if lay.zero >= 2 else p_bytes
    gathers = 2 if lay.zero == 3 and lay.pp == 1 else 1
    dp_bytes = held * (g_bytes + gathers * gathered) / 2 if lay.zero else held * g_bytes
    buckets = math.ceil(held * g_bytes / BUCKET_BYTES)
    dp_time, dp_through = ring_allreduce(dp_bytes, shards, _bandwidth(dp_ranks[:shards], cluster),
                                         rates.latency * buckets)
    if shards < lay.dp * cp:  # hybrid sharding: the shard's gradients all-reduced across the shard groups
        across, across_through = ring_allreduce(held * g_bytes / shards, lay.dp * cp // shards,
                                                _bandwidth(dp_ranks[::shards], cluster), rates.latency * buckets)
        dp_time, dp_through = dp_time + across, dp_through + across_through
    optimizer = held / (shards if lay.zero else 1) / rates.optimizer

    compute = per_rank * (3 * forward + recompute)
    tp_time = per_rank * (tp_forward + tp_backward + tp_recompute)
    allreduces = pace([f + b for f, b in zip(work.forward_allreduces, work.backward_allreduces)])
    tp_bytes = per_rank * allreduces * (1.5 if lay.recompute else 1) * through
    p2p_bytes = per_rank * 2 * activation if lay.pp > 1 else 0.0
    return Prediction(pipeline_time + dp_time + optimizer, compute, tp_time, per_rank * 2 * p2p, ring, bubble,
                      dp_time, optimizer, tp_bytes + p2p_bytes + ring_bytes + dp_through + experts_bytes, experts)


def _expert_parallel(tokens: int, profile: ModelProfile, a_bytes: int, lay, work: StageWork, mesh: ParallelMesh,
                     cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes each device sends) of one micro-batch's dispatch and combine all-to-alls under expert
    parallelism (``experts.all_to_all_bytes``; one latency per peer and all-to-all); zero without it."""
    if lay.ep == 1 or not work.moe_layers:
        return 0.0, 0.0
    rates = cluster.rates
    across = _crosses_nodes(mesh.ep_groups()[0], cluster.devices_per_node)
    link = rates.inter_bandwidth if across else rates.intra_bandwidth
    layers = max(work.moe_layers)
    sent = all_to_all_bytes(tokens // lay.cp, profile.hidden, work.top_k, layers, lay.ep, a_bytes)
    return sent / link + 4 * layers * (lay.ep - 1) * rates.latency, sent


def _context_parallel(tokens: int, profile: ModelProfile, a_bytes: int, cp: int, layers: float, mesh: ParallelMesh,
                      cluster: Cluster) -> tuple[float, float]:
    """(seconds, bytes each device sends) of one micro-batch's ring attention over ``layers`` blocks and the
    gather of the last block's output (module docstring); zero without context parallelism."""
    if cp == 1:
        return 0.0, 0.0
    rates = cluster.rates
    across = _crosses_nodes(mesh.cp_groups()[0], cluster.devices_per_node)
    link = rates.inter_bandwidth if across else rates.intra_bandwidth
    keys = 2 * tokens / cp * profile.kv_hidden  # this rank's keys and values: elements per shift
    sent = layers * ((cp - 1) * 2 * keys * a_bytes + cp * keys * 4)  # forward and backward; float32 gradients
    gather = (cp - 1) / cp * tokens * profile.hidden * a_bytes
    messages = layers * (2 * (cp - 1) + cp) + (cp - 1)
    return (sent + gather) / link + messages * rates.latency, sent + gather
