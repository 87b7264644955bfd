"""Every layout a world of ``nodes x devices_per_node`` processes can train a model with.

A layout is the TP size (a divisor of the devices per node that the model's TP plan accepts: heads,
KV heads, vocabulary), the PP size (at most one stage per block), the CP size (1 unless the options
fix it: context parallelism is asked for, not searched, and never with pipelining), the EP size (likewise
asked for: only without pipelining and ZeRO, a divisor of DP; the routed experts' parameters divided by
it, ``experts.py``), DP taking the processes left, the
micro-batches per replica batch, the pipeline schedule, the ZeRO stage (at stages 2 and 3 also hybrid
sharding over the replicas of one node, ``zero_shard_size``, where a DP group spans nodes) and activation
checkpointing on or off. Every schedule in ``pipeline.schedules.SCHEDULES`` is tried with one and
with two model chunks per rank and kept where ``validate`` accepts it, so a schedule added there is
searched without a change here. Memory per device comes from ``estimate.estimate_memory``; the
layouts whose busiest device does not fit are kept apart, to say what would fit when none does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Optional

from torch import nn

from lightning_parallel.checks.model import check_model
from lightning_parallel.errors import LaunchError
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline.errors import (
    PipelineConfigError,
    PipelineIncompatibleModel,
)
from lightning_parallel.pipeline.partition import StagePlan, find_blocks
from lightning_parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    all_ranks,
    placement_of,
    simulate,
    validate,
)
from lightning_parallel.planner.estimate import (
    RankMemory,
    estimate_memory,
    parameters_per_rank,
    tp_sharded_parameters,
)
from lightning_parallel.planner.experts import expert_elements
from lightning_parallel.planner.profile import ModelProfile, model_profile
from lightning_parallel.tensor_parallel.resolve import divisors

# model chunks per rank tried for every schedule: one (GPipe, 1F1B, ZB-H1) or two (interleaved, V-shaped)
CHUNKS = (1, 2)
# at most this many micro-batches per pipeline stage: the 1F1B bubble (P - 1) / (M + P - 1) is below
# 11 % at M = 8P (Narayanan et al. 2021, arXiv 2104.04473 §3.2), while the cost model charges
# nothing for the slower matmuls and per-micro-batch overheads of smaller micro-batches
MICRO_BATCHES_PER_STAGE = 8


@dataclass(frozen=True)
class Rates:
    """How fast one device computes and its links move bytes (measured or nominal: ``calibrate``)."""

    flops: float  # sustained matmul FLOP/s of one device while all devices compute
    intra_bandwidth: float  # all-reduce bus bandwidth inside a node, bytes/s
    inter_bandwidth: float  # the same across nodes, bytes/s
    latency: float  # seconds per message (per ring step of a collective)
    optimizer: float  # parameters per second an AdamW step updates


@dataclass(frozen=True)
class Cluster:
    """What the search needs to know of the machines."""

    nodes: int
    devices_per_node: int
    device_memory: float  # bytes usable by one process
    rates: Rates
    # the devices of a node are processes on the same CPU cores: while one waits another runs,
    # so a pipeline's idle time is not lost (the rates are then measured with all of them busy)
    shared_compute: bool = False

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Layout:
    """One way to run the model; ``schedule`` is None without pipelining."""

    tp: int
    pp: int
    dp: int
    micro_batches: int = 1
    schedule: Optional[str] = None
    virtual_stages: int = 1
    zero: int = 0  # ZeRO stage: 0 none, 1 optimizer state, 2 and gradients, 3 and parameters
    recompute: bool = False
    cp: int = 1
    ep: int = 1  # expert parallelism: DP ranks holding different experts
    zero_shard: Optional[int] = None  # ZeRO-2/3 sharded over runs of this many DP ranks (HSDP); None: all

    def describe(self) -> str:
        parts = [f"tp={self.tp} pp={self.pp} dp={self.dp}" + (f" cp={self.cp}" if self.cp > 1 else "")
                 + (f" ep={self.ep}" if self.ep > 1 else "")]
        if self.pp > 1:
            chunks = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"{self.schedule}{chunks} m={self.micro_batches}")
        if self.zero:
            parts.append(f"zero{self.zero}" + (f" shard={self.zero_shard}" if self.zero_shard else ""))
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)

    def options(self) -> dict:
        """The ``ParallelStrategy`` arguments of this layout (activation checkpointing is the model's):
        every option the search may choose, so that none is left as "auto"."""
        chosen = {"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "data_parallel": self.dp,
                  "context_parallel": self.cp, "expert_parallel": self.ep, "zero_stage": self.zero,
                  "zero_shard_size": self.zero_shard, "micro_batches": None,
                  "schedule": "1f1b", "virtual_stages": 1}
        if self.pp > 1:
            chosen.update(micro_batches=self.micro_batches, schedule=self.schedule, virtual_stages=self.virtual_stages)
        return chosen

    def overrides(self) -> list[str]:
        """The ``lp-train strategy=auto`` overrides that pin this layout (a search with one candidate)."""
        return [f"strategy.{k}={'null' if v is None else v}" for k, v in self.options().items()]


@dataclass(frozen=True)
class Constraints:
    """Sizes the user fixed; None leaves them to the search."""

    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    micro_batches: Optional[int] = None
    schedule: Optional[str] = None
    virtual_stages: Optional[int] = None
    zero: Optional[int] = None
    zero_shard: Optional[int] = None  # given: only ZeRO-2/3 over runs of that many DP ranks
    recompute: tuple[bool, ...] = (False, True)
    cp: int = 1  # context parallelism is asked for, never searched
    ep: int = 1  # so is expert parallelism (only with pp = 1 and ZeRO 0 or 1, dp a multiple of it)


@dataclass(frozen=True)
class Workload:
    """The training step: sequences per optimizer step and their length, and the number format.

    Give ``global_batch`` (split over the DP replicas, as ``lp-plan --search`` does) or
    ``replica_batch`` (each replica reads that many, as a Lightning loader's ``batch_size`` means).
    """

    seq: int
    precision: str = "32-true"
    global_batch: Optional[int] = None
    replica_batch: Optional[int] = None
    options: ParallelOptions = ParallelOptions()  # the plan, sequence parallelism and block list the layouts use
    example: Any = field(default=None, compare=False, repr=False)  # a batch of the run, to trace the model's costs

    def profile_of(self, model: nn.Module) -> ModelProfile:
        """The model's costs per sample (``profile.model_profile``), traced on ``example`` where it names no sizes."""
        return model_profile(model, self.seq, self.example, self.options.pipeline_blocks)

    def batch_per_replica(self, dp: int) -> Optional[int]:
        if self.replica_batch is not None:
            return self.replica_batch
        return self.global_batch // dp if self.global_batch % dp == 0 else None


@dataclass(frozen=True)
class Candidate:
    """A layout with the split it implies and its memory per device."""

    layout: Layout
    replica_batch: int
    stages: Optional[StagePlan]
    memory: tuple[RankMemory, ...]

    @property
    def peak_bytes(self) -> float:
        return max(m.total_bytes for m in self.memory)


# the split of a model with no repeated blocks, unpipelined: one stage, every module outside the (empty) blocks
WHOLE = StagePlan("", (range(0),), (), (), 1)


@lru_cache(maxsize=4096)
def schedule_actions(name: str, stages: int, micro_batches: int, virtual_stages: int) -> Optional[tuple]:
    """Every rank's actions for ``name``, or None where the schedule refuses these sizes."""
    try:
        ranks = all_ranks(name, stages, micro_batches, virtual_stages)
        validate(ranks, micro_batches)
    except PipelineConfigError:
        return None
    return tuple(tuple(r) for r in ranks)


def pipeline_options(pp: int, replica_batch: int, blocks: int, fixed: Constraints) -> list[tuple[int, str | None, int]]:
    """(micro-batches, schedule, chunks per rank) for ``pp`` stages; one unpipelined option at pp = 1."""
    if pp == 1:
        return [(1, None, 1)]
    counts = [m for m in divisors(replica_batch) if min(pp, replica_batch) <= m <= MICRO_BATCHES_PER_STAGE * pp]
    if fixed.micro_batches is not None:
        counts = [fixed.micro_batches] if replica_batch % fixed.micro_batches == 0 else []
    names = SCHEDULES if fixed.schedule is None else (fixed.schedule,)
    chunks = CHUNKS if fixed.virtual_stages is None else (fixed.virtual_stages,)
    return [
        (m, name, v)
        for m in counts
        for name in names
        for v in chunks
        if pp * v <= blocks and schedule_actions(name, pp, m, v) is not None
    ]


def enumerate_layouts(model: nn.Module, cluster: Cluster, work: Workload,
                      fixed: Constraints = Constraints(), profile: Optional[ModelProfile] = None) -> list[Candidate]:
    """Every layout of ``cluster`` the model splits into, fitting device memory or not (sorted by
    nothing in particular: ``search`` ranks them). ``model`` may live on the meta device; ``profile``
    (default ``work.profile_of(model)``) gives its activations."""
    profile = profile or work.profile_of(model)
    try:
        blocks = len(find_blocks(model, work.options.pipeline_blocks)[1])
    except (PipelineConfigError, PipelineIncompatibleModel):
        blocks = 1  # not pipelined
    world = cluster.world
    splits: dict = {}  # (tp, pp, chunks, placement) -> TP assignments and stages, or None
    held: dict = {}  # (tp, pp, chunks, placement) -> parameters per pipeline rank
    found: list[Candidate] = []
    cp, ep = fixed.cp, fixed.ep
    experts = {}  # tp -> the routed experts' elements per device, which expert parallelism divides
    for tp in divisors(cluster.devices_per_node):
        if world % (tp * cp) or (fixed.tp is not None and tp != fixed.tp):
            continue
        for pp in divisors(world // (tp * cp)) if cp == 1 and ep == 1 else [1]:
            dp = world // (tp * pp * cp)
            if dp % ep or pp > blocks or (fixed.pp is not None and pp != fixed.pp) or (fixed.dp is not None and dp != fixed.dp):
                continue
            replica_batch = work.batch_per_replica(dp)
            if replica_batch is None:
                continue
            for micro_batches, schedule, chunks in pipeline_options(pp, replica_batch, blocks, fixed):
                where = (tp, pp, chunks, schedule or "1f1b")
                split = _split(model, world, where, work, splits, cp, ep)
                if split is not None and split[1] is None and pp == 1:  # no blocks: the whole model is one stage
                    split = (split[0], WHOLE)
                if split is None or split[1] is None:
                    continue
                placed = (tp, pp, chunks, placement_of(schedule or "1f1b"))
                if placed not in held:
                    assignments, stages = split
                    held[placed] = parameters_per_rank(model, stages, tp_sharded_parameters(assignments), tp)
                    if ep > 1:
                        experts[tp] = expert_elements(model, tp_sharded_parameters(assignments), tp)
                        held[placed] = [n - experts[tp] * (ep - 1) // ep for n in held[placed]]
                base = Layout(tp, pp, dp, micro_batches, schedule, chunks, cp=cp, ep=ep)
                for zero in _choices(fixed.zero, dp * cp, cp, ep):
                    for shard in _shard_choices(zero, dp, cluster.devices_per_node // (tp * cp), fixed.zero_shard):
                        for recompute in fixed.recompute:
                            layout = replace(base, zero=zero, zero_shard=shard, recompute=recompute)
                            found.append(_candidate(model, layout, replica_batch, split, held[placed], work, profile))
    return found


def _choices(zero: Optional[int], replicas: int, cp: int, ep: int = 1) -> tuple[int, ...]:
    """ZeRO stages to try over ``replicas`` (DP x CP) ranks: ZeRO-2/3 shard over DP alone and are not
    composed with context parallelism; with expert parallelism only ZeRO-1 where asked (it shards the
    dense parameters' optimizer state, which the estimate does not tell apart from the experts')."""
    if replicas == 1:
        return (0,)  # nothing to shard over (the DP x CP ranks hold the same parameters)
    if ep > 1:
        return (0,) if zero is None else tuple(s for s in (zero,) if s in (0, 1))
    stages = (0, 1) if cp > 1 else (0, 1, 2, 3)
    return stages if zero is None else tuple(s for s in (zero,) if s in stages)


def _shard_choices(zero: int, dp: int, per_node: int, fixed: Optional[int]) -> tuple[Optional[int], ...]:
    """Shard groups to try at ZeRO ``zero`` over ``dp`` replicas, ``per_node`` of which share a node: every
    replica (None), and at stages 2 and 3 also the replicas of one node (HSDP) where the DP group spans
    nodes. A size the user gave is the only choice, and only at stages 2 and 3, where it divides ``dp``."""
    if fixed is not None:
        return (fixed,) if zero >= 2 and dp % fixed == 0 else ()
    if zero >= 2 and 1 < per_node < dp and dp % per_node == 0:
        return (None, per_node)
    return (None,)


def _split(model: nn.Module, world: int, where: tuple[int, int, int, str], work: Workload, splits: dict,
           cp: int = 1, ep: int = 1):
    """TP assignments and stages of ``model`` at ``(tp, pp, chunks per rank, schedule)`` (and ``cp``), or None
    where it does not split so (cached by the stage placement the schedule implies)."""
    tp, pp, chunks, schedule = where
    key = (tp, pp, chunks, placement_of(schedule))
    if key not in splits:
        options = work.options.replace(tensor_parallel=tp, pipeline_parallel=pp, data_parallel="auto",
                                       context_parallel=cp, expert_parallel=ep, schedule=schedule,
                                       virtual_stages=chunks, pipeline_layout=None,
                                       zero_stage=0 if ep > 1 else work.options.zero_stage)
        mesh = ParallelMesh(world, tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp, expert_parallel=ep)
        try:
            splits[key] = check_model(model, mesh, options)
        except LaunchError:
            splits[key] = None
    return splits[key]


@lru_cache(maxsize=4096)
def peak_in_flight(name: Optional[str], stages: int, micro_batches: int, virtual_stages: int) -> list[int]:
    """Micro-batches each rank holds at most (one without pipelining)."""
    if stages == 1:
        return [1]
    return simulate([list(r) for r in schedule_actions(name, stages, micro_batches, virtual_stages)]).peak_in_flight


def _candidate(model: nn.Module, layout: Layout, replica_batch: int, split, params: list[int],
               work: Workload, profile: ModelProfile) -> Candidate:
    assignments, stages = split
    memory = tuple(estimate_memory(
        model, stages, tp_sharded_parameters(assignments), layout.tp, work.seq,
        replica_batch // layout.micro_batches, layout.micro_batches, layout.schedule or "1f1b",
        work.options.sequence_parallel, work.precision, zero_stage=layout.zero, dp=layout.dp * layout.cp,
        recompute=layout.recompute, params=params,
        in_flight=peak_in_flight(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages),
        context_parallel=layout.cp, zero_shard_size=layout.zero_shard, profile=profile,
    ))
    return Candidate(layout, replica_batch, stages, memory)


def actions_of(layout: Layout) -> Optional[tuple[tuple[Action, ...], ...]]:
    """The validated rank schedules of a pipelined layout (None without pipelining)."""
    if layout.pp == 1:
        return None
    return schedule_actions(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages)
