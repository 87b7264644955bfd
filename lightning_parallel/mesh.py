"""The process mesh: world ranks laid out as ``(pp, dp, cp, tp)`` coordinates, and their groups.

Tensor parallelism varies fastest, so a TP group is a run of consecutive global ranks and stays
inside one node (Megatron-LM's ``tp-cp-dp-pp`` order, Narayanan et al. 2021, arXiv 2104.04473 §3.3);
context parallelism (the sequence split over ranks, ``context_parallel/``) comes next, so its ring
stays as close as TP allows, then data parallelism, and pipeline parallelism varies slowest::

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

The arithmetic is pure (no processes needed) and is what ``lp-plan`` prints. ``init_process_groups``
turns it into a ``torch.distributed.device_mesh.DeviceMesh`` of shape ``(pp, dp, tp)`` with the dimension
names ``("pp", "dp", "tp")`` (``(pp, dp, cp, tp)`` and ``"cp"`` when the sequence is split), so DTensor,
FSDP2 (``fully_shard``) and ``torch.distributed.checkpoint`` can work on the same groups; the TP, DP,
CP and PP groups the package uses are that mesh's dimension groups. The parameters are replicated
over the CP ranks of a replica as over its DP peers, so gradients are averaged over one more group,
the DP and CP ranks together (``dp_cp_group``, Megatron-LM's data-parallel group "with context
parallel").

Expert parallelism (``expert_parallel/``) is carved from the DP ranks, as Megatron-LM does for its MoE
layers: the ``dp`` replicas of one ``(pp, cp, tp)`` coordinate form ``dp / ep`` runs of ``ep`` consecutive
replicas, and each run is an EP group whose ranks hold different experts (``ep_rank = dp_rank % ep``).
Dense parameters stay replicated over all DP ranks; an expert's parameters are replicated only over the
replicas with the same ``ep_rank`` (the "expert data parallel" group, ``edp_rank = dp_rank // ep``), and
their gradients are averaged there::

    dp ranks 0 1 2 3, ep=2:  EP groups [0 1] [2 3]   expert-data-parallel groups [0 2] [1 3]

Hybrid sharding (HSDP, ``zero_shard_size``) cuts the DP ranks the same way: runs of ``zero_shard_size``
consecutive replicas shard the parameters among themselves under ZeRO-2/3 (the "dp_shard" groups:
those of one node when a node holds that many replicas) and the runs replicate one another (the
"dp_replicate" groups). ``zero_mesh`` is the DeviceMesh FSDP2 shards over: the ``dp`` dimension, or
the 2-D ``(dp_replicate, dp_shard)`` mesh of this rank's replicas::

    dp ranks 0 1 2 3, zero_shard_size=2:  dp_shard groups [0 1] [2 3]   dp_replicate groups [0 2] [1 3]

How the groups are created depends on the backend, so that a rank's cost does not grow with the world:

- NCCL with a device bound at ``init_process_group`` (the strategy binds one on GPUs): a new group's
  communicator is split from the world's (``ncclCommSplit``), a collective that every rank must enter.
  torch's ``init_device_mesh`` then makes one ``split_group`` call per dimension, so it is used as is.
- Otherwise (gloo, the fake backend, NCCL without a bound device) ``init_device_mesh`` in torch 2.13
  makes every rank call ``new_group`` for every group of every dimension: ``W/tp + W/dp + W/pp`` calls,
  1,088 on each of 4,096 ranks for ``tp=8, pp=8``. Instead each rank creates only the three groups it
  is in (``new_group(..., use_local_synchronization=True)``) and wraps them with ``DeviceMesh.from_group``:
  the same mesh, three calls (four with CP, five with its DP x CP group, two more for the EP and
  expert-data-parallel groups, two for HSDP's) whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel.errors import LaunchError


class MeshError(LaunchError):
    """Sizes that do not fit: a layout that cannot be built from the world size, or that the model does not
    split into (a refusal then lists the layouts the model runs, ``checks/layouts.py``)."""


def splits_world_communicator() -> bool:
    """Whether new groups' communicators are split from the world's, which every rank must enter
    (NCCL with a device bound at ``init_process_group``)."""
    return dist.group.WORLD.bound_device_id is not None


@dataclass(frozen=True)
class MeshCoords:
    pp: int
    dp: int
    tp: int
    cp: int = 0
    ep: int = 0
    """Which experts this rank holds: ``dp % expert_parallel`` (0 without expert parallelism)."""
    edp: int = 0
    """Which replica of its experts this rank is: ``dp // expert_parallel``."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelMesh:
    """Sizes and rank arithmetic of a ``pp x dp x cp x tp`` layout.

    Args:
        world_size: number of processes.
        tensor_parallel: ranks that shard each layer (Megatron TP).
        pipeline_parallel: pipeline stages.
        data_parallel: model replicas; ``"auto"`` (or ``-1``) takes the ranks left over.
        context_parallel: ranks that split each sequence of a replica's batch (``context_parallel/``).
        expert_parallel: data-parallel ranks that hold different experts of each MoE layer
            (``expert_parallel/``); must divide ``data_parallel``.
        zero_shard_size: data-parallel ranks that shard the parameters among themselves under ZeRO-2/3
            (HSDP); must divide ``data_parallel``; None: all of them.
    """

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: Union[int, str] = "auto"
    context_parallel: int = 1
    expert_parallel: int = 1
    zero_shard_size: Optional[int] = None
    _device_mesh: Optional[DeviceMesh] = field(default=None, init=False, repr=False)
    _dp_cp_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)
    _ep_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)
    _edp_group: Optional[dist.ProcessGroup] = field(default=None, init=False, repr=False)
    _hybrid_mesh: Optional[DeviceMesh] = field(default=None, init=False, repr=False)
    rank: Optional[int] = field(default=None, init=False)

    def __post_init__(self) -> None:
        w, t, p, c = self.world_size, self.tensor_parallel, self.pipeline_parallel, self.context_parallel
        for name, value in (("world size", w), ("tensor_parallel", t), ("pipeline_parallel", p),
                            ("context_parallel", c)):
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"{name} must be a positive integer, got {value!r}")
        cp = f" x context_parallel={c}" if c > 1 else ""
        if self.data_parallel in ("auto", -1, None):
            if w % (t * p * c) != 0:
                raise MeshError(
                    f"tensor_parallel={t} x pipeline_parallel={p}{cp} = {t * p * c} does not divide the world "
                    f"size {w}. {self._suggestion()}"
                )
            self.data_parallel = w // (t * p * c)
        d = self.data_parallel
        if not isinstance(d, int) or d < 1:
            raise MeshError(f"data_parallel must be a positive integer or 'auto', got {d!r}")
        if d * t * p * c != w:
            raise MeshError(
                f"data_parallel={d} x tensor_parallel={t} x pipeline_parallel={p}{cp} = {d * t * p * c} processes, "
                f"but the world size is {w}. {self._suggestion()}"
            )
        e = self.expert_parallel
        if not isinstance(e, int) or e < 1:
            raise MeshError(f"expert_parallel must be a positive integer, got {e!r}")
        if d % e:
            fitting = ", ".join(str(k) for k in _divisors(d))
            raise MeshError(
                f"expert_parallel={e} does not divide data_parallel={d}: expert-parallel groups are carved from "
                f"the data-parallel replicas. Use expert_parallel in ({fitting}), or data_parallel a multiple of {e}."
            )
        n = self.zero_shard_size
        if n is not None and (not isinstance(n, int) or n < 1 or d % n):
            fitting = ", ".join(str(k) for k in _divisors(d))
            raise MeshError(
                f"zero_shard_size={n} does not divide data_parallel={d}: the parameters are sharded over runs of "
                f"zero_shard_size replicas. Use zero_shard_size in ({fitting}), or data_parallel a multiple of {n}."
            )

    def _suggestion(self) -> str:
        w, c = self.world_size, self.context_parallel
        cp = f" cp={c}" if c > 1 else ""
        combos = [
            f"tp={t} pp={p}{cp} dp={w // (t * p * c)}"
            for t in _divisors(w)
            for p in _divisors(w // t)
            if (w // (t * p)) % c == 0
        ]
        shown = ", ".join(combos[:12]) + (" ..." if len(combos) > 12 else "")
        return f"Layouts that fit {w} processes: {shown}; or set data_parallel='auto'."

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.tensor_parallel

    @property
    def pp_size(self) -> int:
        return self.pipeline_parallel

    @property
    def dp_size(self) -> int:
        return int(self.data_parallel)

    @property
    def cp_size(self) -> int:
        return self.context_parallel

    @property
    def ep_size(self) -> int:
        return self.expert_parallel

    @property
    def edp_size(self) -> int:
        """Replicas of each expert: the data-parallel ranks over which its gradients are averaged."""
        return self.dp_size // self.ep_size

    @property
    def dp_shard_size(self) -> int:
        """Data-parallel ranks over which ZeRO-2/3 shard the parameters (``zero_shard_size``, or all)."""
        return self.zero_shard_size or self.dp_size

    @property
    def dp_replicate_size(self) -> int:
        """Runs of ``dp_shard_size`` replicas that hold the same shards (1 without hybrid sharding)."""
        return self.dp_size // self.dp_shard_size

    @property
    def is_hybrid_sharded(self) -> bool:
        """Whether ZeRO-2/3 shard over runs of the data-parallel ranks and replicate across them (HSDP)."""
        return self.dp_replicate_size > 1

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh's dimension names, slowest first: ``("pp", "dp", "tp")``, with ``"cp"`` before
        ``"tp"`` when the sequence is split."""
        return ("pp", "dp", "cp", "tp") if self.cp_size > 1 else ("pp", "dp", "tp")

    # ---- pure rank arithmetic -----------------------------------------------------------------
    def coords(self, rank: int) -> MeshCoords:
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of {self.world_size} processes")
        tp = rank % self.tp_size
        cp = (rank // self.tp_size) % self.cp_size
        dp = (rank // (self.tp_size * self.cp_size)) % self.dp_size
        pp = rank // (self.tp_size * self.cp_size * self.dp_size)
        return MeshCoords(pp=pp, dp=dp, tp=tp, cp=cp, ep=dp % self.ep_size, edp=dp // self.ep_size)

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp_size + dp) * self.cp_size + cp) * self.tp_size + tp

    def _groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``: the ranks that share all other coordinates."""
        firsts = [r for r in range(self.world_size) if getattr(self.coords(r), kind) == 0]
        return [self.group_ranks(kind, r) for r in firsts]

    def tp_groups(self) -> list[list[int]]:
        """All TP groups: ranks sharing (pp, dp, cp), varying tp."""
        return self._groups("tp")

    def dp_groups(self) -> list[list[int]]:
        """All DP groups: ranks sharing (pp, cp, tp), varying dp."""
        return self._groups("dp")

    def cp_groups(self) -> list[list[int]]:
        """All CP groups: ranks sharing (pp, dp, tp), varying cp (sequence chunk order)."""
        return self._groups("cp")

    def pp_groups(self) -> list[list[int]]:
        """All pipeline groups: ranks sharing (dp, cp, tp), varying pp (stage order)."""
        return self._groups("pp")

    def dp_cp_groups(self) -> list[list[int]]:
        """All groups over which gradients are averaged: ranks sharing (pp, tp), varying dp and cp."""
        firsts = [r for r in range(self.world_size) if self.coords(r).dp == 0 and self.coords(r).cp == 0]
        return [self.group_ranks("dp_cp", r) for r in firsts]

    def ep_groups(self) -> list[list[int]]:
        """All expert-parallel groups: ``ep_size`` consecutive DP replicas of one (pp, cp, tp) coordinate."""
        firsts = [r for r in range(self.world_size) if self.coords(r).ep == 0]
        return [self.group_ranks("ep", r) for r in firsts]

    def edp_groups(self) -> list[list[int]]:
        """All expert-data-parallel groups: the DP replicas holding the same experts (same ``ep``)."""
        firsts = [r for r in range(self.world_size) if self.coords(r).edp == 0]
        return [self.group_ranks("edp", r) for r in firsts]

    def dp_shard_groups(self) -> list[list[int]]:
        """All HSDP shard groups: runs of ``dp_shard_size`` consecutive DP replicas of one (pp, cp, tp)."""
        firsts = [r for r in range(self.world_size) if self.coords(r).dp % self.dp_shard_size == 0]
        return [self.group_ranks("dp_shard", r) for r in firsts]

    def dp_replicate_groups(self) -> list[list[int]]:
        """All HSDP replicate groups: the DP replicas at the same place of every shard group."""
        firsts = [r for r in range(self.world_size) if self.coords(r).dp < self.dp_shard_size]
        return [self.group_ranks("dp_replicate", r) for r in firsts]

    def sizes(self) -> str:
        """Every dimension in use, slowest first: ``pp=1 x dp=4 (ep=2) x tp=1`` (the EP groups are carved from the
        DP replicas, so ``ep`` stands beside ``dp`` rather than in the product), ``cp`` where the sequence is split."""
        ep = f" (ep={self.ep_size})" if self.ep_size > 1 else ""
        cp = f" x cp={self.cp_size}" if self.cp_size > 1 else ""
        return f"pp={self.pp_size} x dp={self.dp_size}{ep}{cp} x tp={self.tp_size}"

    def describe(self, devices_per_node: Optional[int] = None) -> str:
        """A human-readable table of every rank's coordinates (and node, when known)."""
        lines = [f"mesh: {self.sizes()} = {self.world_size} processes"]
        for r in range(self.world_size):
            c = self.coords(r)
            node = f" node {r // devices_per_node}" if devices_per_node else ""
            chunk = f" sequence part {c.cp}" if self.cp_size > 1 else ""
            lines.append(f"  rank {r:>4}: stage {c.pp} replica {c.dp}{chunk} shard {c.tp}{node}")
        for kind in ("tp", "cp", "dp", "pp") if self.cp_size > 1 else ("tp", "dp", "pp"):
            groups = getattr(self, f"{kind}_groups")()
            lines.append(f"  {kind} groups: " + " ".join(str(g) for g in groups))
        if self.ep_size > 1:
            lines.append("  ep groups: " + " ".join(str(g) for g in self.ep_groups()))
            lines.append("  expert dp groups: " + " ".join(str(g) for g in self.edp_groups()))
        if self.is_hybrid_sharded:
            lines.append("  zero shard groups: " + " ".join(str(g) for g in self.dp_shard_groups()))
            lines.append("  zero replicate groups: " + " ".join(str(g) for g in self.dp_replicate_groups()))
        return "\n".join(lines)

    # ---- process groups -----------------------------------------------------------------------
    def init_process_groups(self, rank: int, device_type: str = "cpu") -> "ParallelMesh":
        """Create this rank's TP, DP, PP (and CP) groups and the ``DeviceMesh`` over them (every rank calls it).

        ``device_type`` is the DeviceMesh's device (``"cuda"`` for NCCL, ``"cpu"`` for gloo).
        """
        if dist.get_world_size() != self.world_size:
            raise MeshError(
                f"the mesh was built for {self.world_size} processes but torch.distributed has "
                f"{dist.get_world_size()}"
            )
        self.rank = rank
        names = self.dims
        shape = tuple(getattr(self, f"{name}_size") for name in names)
        if splits_world_communicator():
            self._device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            if self.cp_size > 1:
                self._dp_cp_group = dist.split_group(split_ranks=self.dp_cp_groups())
            if self.ep_size > 1:
                self._ep_group = dist.split_group(split_ranks=self.ep_groups())
                self._edp_group = dist.split_group(split_ranks=self.edp_groups())
            if self.is_hybrid_sharded:
                self._hybrid_mesh = self._dp_mesh(dist.split_group(split_ranks=self.dp_replicate_groups()),
                                                  dist.split_group(split_ranks=self.dp_shard_groups()), device_type)
            return self
        # the same order on every rank, so the groups' barriers cannot wait on each other
        groups = [self.subgroup(self.group_ranks(kind, rank)) for kind in names]
        layout = torch.arange(self.world_size).view(shape)
        self._device_mesh = DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=names)
        if self.cp_size > 1:
            self._dp_cp_group = self.subgroup(self.group_ranks("dp_cp", rank))
        if self.ep_size > 1:
            self._ep_group = self.subgroup(self.group_ranks("ep", rank))
            self._edp_group = self.subgroup(self.group_ranks("edp", rank))
        if self.is_hybrid_sharded:
            self._hybrid_mesh = self._dp_mesh(self.subgroup(self.group_ranks("dp_replicate", rank)),
                                              self.subgroup(self.group_ranks("dp_shard", rank)), device_type)
        return self

    def _dp_mesh(self, replicate: dist.ProcessGroup, shard: dist.ProcessGroup, device_type: str) -> DeviceMesh:
        """The 2-D ``(dp_replicate, dp_shard)`` DeviceMesh of this rank's DP replicas, over the two groups."""
        layout = torch.tensor(self.group_ranks("dp", self.rank)).view(self.dp_replicate_size, self.dp_shard_size)
        return DeviceMesh.from_group([replicate, shard], device_type, mesh=layout,
                                     mesh_dim_names=("dp_replicate", "dp_shard"))

    def group_ranks(self, kind: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s ``kind`` group (``"tp"``, ``"dp"``, ``"cp"``, ``"pp"``, ``"dp_cp"``, ``"ep"``,
        ``"edp"``, ``"dp_shard"`` or ``"dp_replicate"``), in O(group size)."""
        c = self.coords(rank)
        if kind == "tp":
            return [self.rank_of(c.pp, c.dp, t, c.cp) for t in range(self.tp_size)]
        if kind == "dp":
            return [self.rank_of(c.pp, d, c.tp, c.cp) for d in range(self.dp_size)]
        if kind == "cp":
            return [self.rank_of(c.pp, c.dp, c.tp, k) for k in range(self.cp_size)]
        if kind == "pp":
            return [self.rank_of(p, c.dp, c.tp, c.cp) for p in range(self.pp_size)]
        if kind == "dp_cp":
            return [self.rank_of(c.pp, d, c.tp, k) for d in range(self.dp_size) for k in range(self.cp_size)]
        if kind == "dp_shard":
            first = c.dp - c.dp % self.dp_shard_size
            return [self.rank_of(c.pp, first + k, c.tp, c.cp) for k in range(self.dp_shard_size)]
        if kind == "dp_replicate":
            at = c.dp % self.dp_shard_size
            return [self.rank_of(c.pp, at + k * self.dp_shard_size, c.tp, c.cp) for k in range(self.dp_replicate_size)]
        if kind == "ep":
            first = c.edp * self.ep_size
            return [self.rank_of(c.pp, first + e, c.tp, c.cp) for e in range(self.ep_size)]
        if kind == "edp":
            return [self.rank_of(c.pp, c.ep + k * self.ep_size, c.tp, c.cp) for k in range(self.edp_size)]
        raise ValueError(f"unknown group kind {kind!r}; use 'tp', 'dp', 'cp', 'pp', 'dp_cp', 'ep', 'edp', "
                         "'dp_shard' or 'dp_replicate'")

    @staticmethod
    def subgroup(ranks: Sequence[int]) -> dist.ProcessGroup:
        """A process group of ``ranks``, created by its members only (the caller must be one).

        Ranks outside the group do not call in, so a rank's cost does not grow with the world.
        torch names such a group after its ranks and the number of groups the caller already
        holds, so the members must create the same groups, in the same order, before this one.
        """
        if dist.get_rank() not in ranks:
            raise MeshError(f"rank {dist.get_rank()} creates a group of ranks {list(ranks)} without being in it; "
                            "only the members of a group create it")
        return dist.new_group(list(ranks), use_local_synchronization=True)

    def stage_groups(self, stage_sets: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """A group for each set of pipeline stages of this rank's pipeline that contains this rank's stage
        (for a weight several stages hold, e.g. a tied embedding and head); every rank calls it with the
        same sets.

        The set of all stages is the mesh's pp group. When groups are split from the world's communicator
        (see the module docstring), each other set is one ``split_group`` call of every rank, for all
        pipelines at once. Otherwise it is created by its members only (``subgroup``); a rank outside a
        set creates a group of itself in its place, so that every rank of the pipeline has created as
        many groups before each set and the members agree on its name.
        """
        groups = {}
        for stages in dict.fromkeys(tuple(s) for s in stage_sets):
            if len(stages) == self.pp_size:
                groups[stages] = self.pp_group
            elif splits_world_communicator():
                group = dist.split_group(split_ranks=[[pipeline[s] for s in stages] for pipeline in self.pp_groups()])
                if self.pp_rank in stages:
                    groups[stages] = group
            elif self.pp_rank in stages:
                groups[stages] = self.subgroup([self.stage_rank(s) for s in stages])
            else:
                self.subgroup([self.rank])
        return groups

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(pp, dp, tp)`` DeviceMesh; e.g. ``mesh.device_mesh["tp"]`` for a DTensor over the TP group."""
        if self._device_mesh is None:
            raise RuntimeError("ParallelMesh.init_process_groups() has not been called on this rank")
        return self._device_mesh

    @property
    def zero_mesh(self) -> DeviceMesh:
        """The DeviceMesh ZeRO-2/3 shard over: the ``dp`` dimension, or under hybrid sharding the 2-D
        ``(dp_replicate, dp_shard)`` mesh of this rank's replicas (FSDP2 then shards over ``dp_shard``
        and replicates over ``dp_replicate``)."""
        return self._hybrid_mesh if self.is_hybrid_sharded else self.device_mesh["dp"]

    @property
    def zero_shard_group(self) -> dist.ProcessGroup:
        """The replicas holding disjoint shards under ZeRO-2/3: the ``dp_shard`` group, or the DP group."""
        return self.zero_mesh.get_group("dp_shard") if self.is_hybrid_sharded else self.dp_group

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The ranks that split this rank's sequences (a mesh dimension only with ``context_parallel`` > 1)."""
        return self.device_mesh.get_group("cp")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The ranks gradients are averaged over: the DP group, times the CP group when the sequence is split."""
        return self.dp_group if self.cp_size == 1 else self._dp_cp_group

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The ranks this rank exchanges tokens with (expert parallelism); the DP group's run holding it."""
        if self._ep_group is None:
            raise RuntimeError("no expert-parallel group: expert_parallel is 1 or the groups are not created")
        return self._ep_group

    @property
    def edp_group(self) -> dist.ProcessGroup:
        """The replicas of this rank's experts, over which their gradients are summed."""
        if self._edp_group is None:
            raise RuntimeError("no expert-data-parallel group: expert_parallel is 1 or the groups are not created")
        return self._edp_group

    @property
    def ep_rank(self) -> int:
        return self.my_coords.ep

    @property
    def my_coords(self) -> MeshCoords:
        if self.rank is None:
            raise RuntimeError("ParallelMesh.init_process_groups() has not been called on this rank")
        return self.coords(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.my_coords.tp

    @property
    def dp_rank(self) -> int:
        return self.my_coords.dp

    @property
    def pp_rank(self) -> int:
        return self.my_coords.pp

    @property
    def cp_rank(self) -> int:
        return self.my_coords.cp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipeline."""
        c = self.my_coords
        return self.rank_of(stage, c.dp, c.tp, c.cp)

    @property
    def pp_next_rank(self) -> Optional[int]:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    @property
    def pp_prev_rank(self) -> Optional[int]:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor (a parameter or gradient that ZeRO-2/3
    shards over the ``dp`` dimension), the tensor itself otherwise. Shares its storage."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
