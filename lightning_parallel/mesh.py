"""The process mesh: world ranks laid out as ``(pp, dp, tp)`` coordinates, and their groups.

Tensor parallelism varies fastest, so a TP group is a run of consecutive global ranks and stays
inside one node (Megatron-LM's ``tp-dp-pp`` order, Narayanan et al. 2021, arXiv 2104.04473 §3.3);
data parallelism comes next and pipeline parallelism varies slowest::

    rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank

The arithmetic is pure (no processes needed) and is what ``lp-plan`` prints. ``init_process_groups``
turns it into ``torch.distributed`` groups; every rank creates every group in the same order, as
``new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch.distributed as dist


class MeshError(ValueError):
    """A layout that cannot be built from the world size."""


@dataclass(frozen=True)
class MeshCoords:
    pp: int
    dp: int
    tp: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelMesh:
    """Sizes and rank arithmetic of a ``pp x dp x tp`` layout.

    Args:
        world_size: number of processes.
        tensor_parallel: ranks that shard each layer (Megatron TP).
        pipeline_parallel: pipeline stages.
        data_parallel: model replicas; ``"auto"`` (or ``-1``) takes the ranks left over.
    """

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: Union[int, str] = "auto"
    _groups: dict = field(default_factory=dict, init=False, repr=False)
    rank: Optional[int] = field(default=None, init=False)

    def __post_init__(self) -> None:
        w, t, p = self.world_size, self.tensor_parallel, self.pipeline_parallel
        for name, value in (("world size", w), ("tensor_parallel", t), ("pipeline_parallel", p)):
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"{name} must be a positive integer, got {value!r}")
        if self.data_parallel in ("auto", -1, None):
            if w % (t * p) != 0:
                raise MeshError(
                    f"tensor_parallel={t} x pipeline_parallel={p} = {t * p} does not divide the world size {w}. "
                    f"{self._suggestion()}"
                )
            self.data_parallel = w // (t * p)
        d = self.data_parallel
        if not isinstance(d, int) or d < 1:
            raise MeshError(f"data_parallel must be a positive integer or 'auto', got {d!r}")
        if d * t * p != w:
            raise MeshError(
                f"data_parallel={d} x tensor_parallel={t} x pipeline_parallel={p} = {d * t * p} processes, "
                f"but the world size is {w}. {self._suggestion()}"
            )

    def _suggestion(self) -> str:
        w = self.world_size
        combos = [
            f"tp={t} pp={p} dp={w // (t * p)}"
            for t in _divisors(w)
            for p in _divisors(w // t)
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

    # ---- pure rank arithmetic -----------------------------------------------------------------
    def coords(self, rank: int) -> MeshCoords:
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of {self.world_size} processes")
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return MeshCoords(pp=pp, dp=dp, tp=tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp_size + dp) * self.tp_size + tp

    def tp_groups(self) -> list[list[int]]:
        """All TP groups: ranks sharing (pp, dp), varying tp."""
        return [
            [self.rank_of(p, d, t) for t in range(self.tp_size)]
            for p in range(self.pp_size)
            for d in range(self.dp_size)
        ]

    def dp_groups(self) -> list[list[int]]:
        """All DP groups: ranks sharing (pp, tp), varying dp."""
        return [
            [self.rank_of(p, d, t) for d in range(self.dp_size)]
            for p in range(self.pp_size)
            for t in range(self.tp_size)
        ]

    def pp_groups(self) -> list[list[int]]:
        """All pipeline groups: ranks sharing (dp, tp), varying pp (stage order)."""
        return [
            [self.rank_of(p, d, t) for p in range(self.pp_size)]
            for d in range(self.dp_size)
            for t in range(self.tp_size)
        ]

    def group_ranks(self, kind: str, rank: int) -> list[int]:
        groups = {"tp": self.tp_groups, "dp": self.dp_groups, "pp": self.pp_groups}[kind]()
        return next(g for g in groups if rank in g)

    def describe(self, devices_per_node: Optional[int] = None) -> str:
        """A human-readable table of every rank's coordinates (and node, when known)."""
        lines = [f"mesh: pp={self.pp_size} x dp={self.dp_size} x tp={self.tp_size} = {self.world_size} processes"]
        for r in range(self.world_size):
            c = self.coords(r)
            node = f" node {r // devices_per_node}" if devices_per_node else ""
            lines.append(f"  rank {r:>4}: stage {c.pp} replica {c.dp} shard {c.tp}{node}")
        for kind in ("tp", "dp", "pp"):
            groups = getattr(self, f"{kind}_groups")()
            lines.append(f"  {kind} groups: " + " ".join(str(g) for g in groups))
        return "\n".join(lines)

    # ---- process groups -----------------------------------------------------------------------
    def init_process_groups(self, rank: int) -> "ParallelMesh":
        """Create the TP, DP and PP groups (collective: every rank must call it, same order)."""
        if dist.get_world_size() != self.world_size:
            raise MeshError(
                f"the mesh was built for {self.world_size} processes but torch.distributed has "
                f"{dist.get_world_size()}"
            )
        self.rank = rank
        for kind in ("tp", "dp", "pp"):
            for ranks in getattr(self, f"{kind}_groups")():
                group = dist.new_group(ranks)
                if rank in ranks:
                    self._groups[kind] = group
        return self

    def _group(self, kind: str):
        if kind not in self._groups:
            raise RuntimeError("ParallelMesh.init_process_groups() has not been called on this rank")
        return self._groups[kind]

    @property
    def tp_group(self):
        return self._group("tp")

    @property
    def dp_group(self):
        return self._group("dp")

    @property
    def pp_group(self):
        return self._group("pp")

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
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipeline."""
        c = self.my_coords
        return self.rank_of(stage, c.dp, c.tp)

    @property
    def pp_next_rank(self) -> Optional[int]:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    @property
    def pp_prev_rank(self) -> Optional[int]:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)
