"""``ParallelOptions``: the layout and every parallelism option of a strategy, in one frozen object.

Built once, from the strategy's arguments (``ParallelStrategy(tensor_parallel=2, ...)``) or from a
Hydra ``strategy`` config (``ParallelOptions.from_mapping``), validated here, and passed whole to
the launch checks, the pipeline engine, the planner and the checkpoint code. A size given as
``"auto"`` is left to the planner (``planner/auto.py``), which returns a copy with the sizes filled
in (``resolved``); until then it reads as its default where a number is needed (``tp``, ``pp``).
The Lightning plumbing (accelerator, devices, cluster environment, launcher, timeout) stays with
the strategy: it says how processes start, not how the model is split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_parallel.errors import ConfigurationError

AUTO = "auto"
# options whose "auto" asks for the planner's search (data_parallel="auto" alone takes the processes left)
SEARCHED = ("tensor_parallel", "pipeline_parallel", "schedule", "virtual_stages", "zero_stage")
ZERO_STAGES = (0, 1, 2, 3)


def _size(name: str, value: Any, allow_none: bool = False) -> Union[int, str, None]:
    if value is None and allow_none:
        return None
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        if isinstance(value, str) and value.isdigit():
            return _size(name, int(value))
        expected = "a positive integer, 'auto'" + (" or None" if allow_none else "")
        raise ConfigurationError(f"{name} must be {expected}, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelOptions:
    """How the model is split over the processes, and how each parallelism runs."""

    tensor_parallel: Union[int, str] = 1
    """Ranks that shard each layer, Megatron style (keep a TP group inside a node). ``"auto"``: the
    planner chooses at setup."""

    pipeline_parallel: Union[int, str] = 1
    """Pipeline stages. ``"auto"``: the planner chooses."""

    data_parallel: Union[int, str] = AUTO
    """Model replicas; ``"auto"`` takes the processes left over after TP, CP and PP."""

    context_parallel: int = 1
    """Ranks that split each sequence of a replica's batch, load-balanced for causal attention, with
    ring attention between them (``context_parallel/``); the sequence length must divide by
    ``2 * context_parallel``."""

    expert_parallel: int = 1
    """Data-parallel ranks that hold different whole experts of each Mixture-of-Experts layer, tokens sent
    to their experts' rank and back with all-to-all (``expert_parallel/``); must divide ``data_parallel``
    and each MoE layer's expert count. Expert gradients are averaged over the replicas holding the same
    experts, the rest over all data-parallel ranks. Not with pipeline or context parallelism, nor ZeRO-2/3
    (ZeRO-1 shards the dense parameters' optimizer state)."""

    micro_batches: Optional[int] = None
    """Micro-batches per training batch under pipeline parallelism; None: one per stage."""

    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b``, ``gpipe``, ``interleaved_1f1b``, or the zero-bubble ``zb_h1``, ``zbv``,
    ``dualpipev``; ``"auto"``: the planner chooses."""

    virtual_stages: Union[int, str] = 1
    """Model chunks per rank for ``interleaved_1f1b``; the V-shaped ``zbv`` and ``dualpipev`` hold 2."""

    sequence_parallel: bool = False
    """Shard norm and dropout regions along the sequence under TP (Korthikanti et al. 2022)."""

    tp_plan: Optional[Mapping[str, Any]] = None
    """Module-name glob -> style (``colwise``, ``rowwise``, ``vocab``, or a dict with ``style`` and options
    such as ``fused: 3``); None: carried by a Hugging Face model, or detected."""

    pipeline_blocks: Optional[str] = None
    """Dotted path of the repeated block list the pipeline splits; None: found."""

    pipeline_layout: Optional[tuple[int, ...]] = None
    """Blocks per stage, e.g. ``(3, 5)``; None: balanced by parameter count."""

    bucket_size_mb: float = 25.0
    """Data-parallel all-reduce bucket size, MiB of gradients."""

    zero_stage: Union[int, str] = 0
    """What the data-parallel replicas shard among themselves (Rajbhandari et al. 2020): ``0`` nothing;
    ``1`` optimizer state (ZeRO-1); ``2`` gradients too, parameters gathered once per step; ``3``
    parameters gathered block by block for forward and again for backward, freed after each. At 2 and 3
    every rank keeps 1/dp of the parameters between steps (``data_parallel/fully_sharded.py``).
    ``"auto"``: the planner chooses."""

    zero_shard_size: Optional[int] = None
    """Under ZeRO-2/3, the data-parallel ranks that shard the parameters among themselves (HSDP, hybrid
    sharding: Zhao et al. 2023, "PyTorch FSDP", arXiv 2304.11277 §3.2.2): runs of this many consecutive
    replicas (the replicas of one node, say) each keep ``1/zero_shard_size`` of the parameters,
    gradients and optimizer state, and the runs are replicas of one another; gradients are
    reduce-scattered inside a run and all-reduced across runs. Must divide ``data_parallel``; None
    shards over all of them (plain ZeRO-2/3)."""

    broadcast_buffers: bool = True
    """As DDP's: before a forward that follows one that synchronised gradients, the data-parallel
    replicas receive the first replica's buffers (BatchNorm's running statistics), so all of them
    validate with the same (``data_parallel/buffers.py``); ``False`` leaves each replica its own."""

    verify_split: bool = True
    """With tensor parallelism, check at setup that the split computes what the whole model computes:
    one block of each kind, the embedding and the head run whole and split in float64 on one
    micro-batch, outputs and gradients compared (``checks/verify_split.py``); ``False`` skips it."""

    replica_groups: int = 1
    """Replica groups of the whole run, each launched on its own (its own ``lp-train`` or SLURM job) with this
    layout inside; their gradients are averaged every step across the groups alive, so a group that dies
    leaves the others training at a smaller global batch, and a restarted one copies the live state from a
    healthy group (torchft, ``fault_tolerance/``). 1: one group, no quorum server."""

    replica_group: int = 0
    """Which of the ``replica_groups`` this launch is, ``0 .. replica_groups - 1`` (its share of the data)."""

    lighthouse: Optional[str] = None
    """Address of the quorum server the replica groups meet at, ``http://HOST:PORT`` (``lp-lighthouse``);
    needed when ``replica_groups > 1``."""

    searched: tuple[str, ...] = field(default=(), init=False, compare=False)
    """The options given as ``"auto"`` that the planner has not resolved yet (derived; not an argument)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "tensor_parallel", _size("tensor_parallel", self.tensor_parallel))
        set_(self, "pipeline_parallel", _size("pipeline_parallel", self.pipeline_parallel))
        set_(self, "data_parallel", AUTO if self.data_parallel in (None, -1) else _size("data_parallel",
                                                                                      self.data_parallel))
        set_(self, "context_parallel", _size("context_parallel", self.context_parallel))
        if self.context_parallel == AUTO:
            raise ConfigurationError("context_parallel is not searched: give the number of ranks that split each "
                                     "sequence (1 for none)")
        set_(self, "expert_parallel", _size("expert_parallel", self.expert_parallel))
        if self.expert_parallel == AUTO:
            raise ConfigurationError("expert_parallel is not searched: give the number of data-parallel ranks that "
                                     "hold different experts (1 for none)")
        self._refuse_with_experts()
        set_(self, "virtual_stages", _size("virtual_stages", self.virtual_stages))
        if self.micro_batches is not None:
            set_(self, "micro_batches", _size("micro_batches", self.micro_batches))
            if self.micro_batches == AUTO:
                set_(self, "micro_batches", None)
        if self.zero_stage not in (*ZERO_STAGES, AUTO):
            raise ConfigurationError(
                "zero_stage must be 0 (off), 1 (shard optimizer state), 2 (and gradients), 3 (and parameters) "
                f"or 'auto', got {self.zero_stage!r}")
        if self.zero_stage in (2, 3) and self.context_parallel > 1:
            raise ConfigurationError(
                f"zero_stage={self.zero_stage} shards parameters over the data-parallel replicas alone, while "
                f"context_parallel={self.context_parallel} ranks hold the same parameters and need their gradients "
                "averaged too; with context parallelism use zero_stage=1 (optimizer state sharded over DP x CP), "
                "or zero_stage=2/3 without it")
        self._check_shard_size()
        self._check_replica_groups()
        if self.tp_plan is not None:
            set_(self, "tp_plan", dict(self.tp_plan))
        if self.pipeline_layout is not None:
            set_(self, "pipeline_layout", tuple(int(n) for n in self.pipeline_layout))
        set_(self, "searched", tuple(name for name in SEARCHED if getattr(self, name) == AUTO))

    def _check_shard_size(self) -> None:
        """``zero_shard_size`` is a positive size, and shards parameters (ZeRO-2/3); that it divides the
        data-parallel size is checked where that size is known (``checks/launch.py``)."""
        size = self.zero_shard_size
        if size is None:
            return
        if isinstance(size, str) and size.isdigit():
            object.__setattr__(self, "zero_shard_size", size := int(size))
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(f"zero_shard_size must be a positive integer (data-parallel ranks that shard "
                                     f"the parameters among themselves) or None, got {size!r}")
        if self.zero_stage not in (2, 3, AUTO):
            raise ConfigurationError(
                f"zero_shard_size={size} shards parameters over groups of {size} data-parallel ranks, which only "
                f"ZeRO-2/3 do, but zero_stage={self.zero_stage}; use zero_stage=3 (or 2) with zero_shard_size={size}, "
                "or leave zero_shard_size unset (None)")

    def _check_replica_groups(self) -> None:
        """A group number inside the run, and the quorum server's address where there are several groups."""
        groups = _size("replica_groups", self.replica_groups)
        object.__setattr__(self, "replica_groups", groups)
        if groups == AUTO:
            raise ConfigurationError("replica_groups is not searched: give the number of replica groups the run is "
                                     "made of (1 for one)")
        group = self.replica_group
        if isinstance(group, str) and group.isdigit():
            group = int(group)
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
            raise ConfigurationError(f"replica_group must be one of 0..{groups - 1} (replica_groups={groups}), "
                                     f"got {self.replica_group!r}")
        object.__setattr__(self, "replica_group", group)
        if groups > 1 and not (isinstance(self.lighthouse, str) and self.lighthouse.startswith(("http://",
                                                                                               "https://"))):
            raise ConfigurationError(
                f"replica_groups={groups} needs the quorum server's address, lighthouse='http://HOST:PORT' "
                f"(start it with `lp-lighthouse --port PORT`), got lighthouse={self.lighthouse!r}")
        if groups > 1 and self.zero in (2, 3):
            raise ConfigurationError(
                f"replica_groups={groups} with zero_stage={self.zero} is not supported: a restarted group does not "
                "yet rejoin groups whose parameters are sharded FSDP2 DTensors; use zero_stage 0 or 1 inside each "
                "replica group")

    def _refuse_with_experts(self) -> None:
        """Expert parallelism composes with data and tensor parallelism only (so far)."""
        ep = self.expert_parallel
        if ep == 1:
            return
        others = [(f"pipeline_parallel={self.pipeline_parallel}", self.pipeline_parallel not in (1, AUTO)),
                  (f"context_parallel={self.context_parallel}", self.context_parallel != 1),
                  (f"zero_stage={self.zero_stage}", self.zero_stage not in (0, 1, AUTO))]
        for what, given in others:
            if given:
                raise ConfigurationError(
                    f"expert_parallel={ep} with {what} is not supported: expert parallelism composes with data "
                    f"parallelism (data_parallel a multiple of {ep}) and tensor parallelism, with "
                    "pipeline_parallel=1, context_parallel=1 and zero_stage 0 or 1; drop one of the two")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ParallelOptions":
        """The options among ``values`` (a strategy's keyword arguments or Hydra config; other keys such
        as ``_target_`` or ``start_method`` are the strategy's own and ignored here)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "searched"}
        return cls(**{k: v for k, v in values.items() if k in names})

    # ---- the sizes as numbers -----------------------------------------------------------------
    @property
    def is_auto(self) -> bool:
        """Whether some option waits for the planner's search."""
        return bool(self.searched)

    @property
    def tp(self) -> int:
        return 1 if self.tensor_parallel == AUTO else int(self.tensor_parallel)

    @property
    def pp(self) -> int:
        return 1 if self.pipeline_parallel == AUTO else int(self.pipeline_parallel)

    @property
    def cp(self) -> int:
        return int(self.context_parallel)

    @property
    def ep(self) -> int:
        return int(self.expert_parallel)

    @property
    def zero(self) -> int:
        return 0 if self.zero_stage == AUTO else int(self.zero_stage)

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-2 or 3: each data-parallel rank keeps a shard of the parameters between steps."""
        return self.zero >= 2

    @property
    def schedule_name(self) -> str:
        return "1f1b" if self.schedule == AUTO else self.schedule

    @property
    def chunks(self) -> int:
        """Model chunks per rank the schedule runs (``pipeline.schedules.chunks_per_rank``)."""
        from lightning_parallel.pipeline.schedules import chunks_per_rank

        return chunks_per_rank(self.schedule_name, 1 if self.virtual_stages == AUTO else int(self.virtual_stages))

    @property
    def is_model_split(self) -> bool:
        """Whether ranks hold different parameters: TP shards, pipeline stages, or experts (EP)."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1

    @property
    def mesh_sizes(self) -> dict[str, Union[int, str]]:
        return {"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "data_parallel": self.data_parallel,
                "context_parallel": self.cp, "expert_parallel": self.ep,
                "zero_shard_size": self.zero_shard_size if self.shards_parameters else None}

    def replace(self, **changes: Any) -> "ParallelOptions":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def unsearched(self) -> "ParallelOptions":
        """A copy with every option given as ``"auto"`` at its default: the layout without a search."""
        return self.replace(**{name: ParallelOptions.__dataclass_fields__[name].default for name in self.searched})

    def resolved(self, chosen: Mapping[str, Any]) -> "ParallelOptions":
        """The options with the planner's choice (``planner.space.Layout.options()``) filled in."""
        return self.replace(**chosen)
