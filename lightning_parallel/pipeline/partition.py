"""Which stage owns which part of an unchanged model (pure logic, no processes).

The model's repeated blocks (the largest ``nn.ModuleList``/``nn.Sequential`` of same-type modules,
or the path given as ``blocks``) are cut into contiguous stages balanced by parameter count, or
by an explicit ``layout`` of blocks per stage. The parameter-holding modules that run before
the blocks (embeddings) belong to the first stage, those that run after them (final norm, head) to
the last stage. Where they run is learned from one forward (``order.trace_run_order``); without
one, registration order stands in for it (registered before the block list: runs before it), and
the stand-ins check that order at run time. With
``V`` virtual stages per rank, which rank holds which stage is ``schedules.placement``'s choice ("loop":
stage ``s`` on rank ``s % P``; "v" for the V-shaped schedules).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from torch import nn

from lightning_parallel.pipeline.errors import (
    PipelineConfigError,
    PipelineIncompatibleModel,
)
from lightning_parallel.pipeline.order import RunOrder, outside_blocks
from lightning_parallel.pipeline.schedules.placement import check as check_placement
from lightning_parallel.pipeline.schedules.placement import (
    rank_of_stage,
    stages_of_rank,
)


def find_blocks(module: nn.Module, path: str | None = None) -> tuple[str, nn.Module]:
    """The block list: ``path`` if given, else the largest list of same-type modules by parameters."""
    if path is not None:
        try:
            blocks = module.get_submodule(path)
        except AttributeError as err:
            raise PipelineConfigError(f"pipeline_blocks={path!r} is not a submodule of {type(module).__name__}") from err
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            raise PipelineConfigError(f"pipeline_blocks={path!r} must name a non-empty nn.ModuleList or nn.Sequential")
        return path, blocks
    candidates = [
        (sum(p.numel() for p in m.parameters()), name, m)
        for name, m in module.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and len({type(b) for b in m}) == 1
    ]
    if not candidates:
        raise PipelineIncompatibleModel(
            f"{type(module).__name__} has no nn.ModuleList or nn.Sequential of repeated blocks to split into "
            "pipeline stages; set pipeline_blocks to the path of the block list"
        )
    _, name, blocks = max(candidates, key=lambda c: c[0])
    return name, blocks


def block_lists(module: nn.Module, near: str | None = None) -> list[str]:
    """Paths of every ``nn.ModuleList``/``nn.Sequential`` in ``module`` with two or more entries: the
    candidates for ``pipeline_blocks``, the closest to ``near`` first, then the largest."""
    found = [(sum(p.numel() for p in m.parameters()), name) for name, m in module.named_modules()
             if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    ranked = [name for _, name in sorted(found, key=lambda f: -f[0])]
    close = difflib.get_close_matches(near, ranked, n=len(ranked), cutoff=0.6) if near else []
    return close + [name for name in ranked if name not in close]


def outer_modules(module: nn.Module, blocks_path: str) -> tuple[list[str], list[str]]:
    """Names of the largest parameter-holding submodules outside the blocks, registered before / after them."""
    outside = list(outside_blocks(module, blocks_path))
    return [n for n, _, after in outside if not after], [n for n, _, after in outside if after]


def balance(costs: list[int], parts: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Blocks per stage: a contiguous split of ``costs`` into ``parts`` that minimises the largest stage.

    ``first_extra``/``last_extra`` are the costs the first and last stage carry besides blocks.
    Dynamic programming over split points (the linear partition problem), exact for any costs.
    """
    n = len(costs)
    if parts > n:
        raise PipelineConfigError(
            f"{parts} pipeline stages but the model has only {n} blocks; use at most {n} stages "
            "(pipeline_parallel x virtual_stages)"
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == parts - 1 else 0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[k][j]: smallest possible max stage cost putting blocks[:j] into stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(k - 1, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    sizes = []
    j = n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


@dataclass(frozen=True)
class StagePlan:
    """Blocks of every (virtual) stage, and the modules before and after the blocks.

    ``traced``: whether ``pre``/``post`` come from a traced forward (else from registration order).
    ``placement``: which rank holds which stage (``schedules.placement.PLACEMENTS``).
    """

    blocks_path: str
    stage_blocks: tuple[range, ...]
    pre: tuple[str, ...]
    post: tuple[str, ...]
    ranks: int
    traced: bool = False
    placement: str = "loop"

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    def rank_of_stage(self, stage: int) -> int:
        return rank_of_stage(stage, self.ranks, self.num_stages, self.placement)

    def stages_of_rank(self, rank: int) -> list[int]:
        return stages_of_rank(rank, self.ranks, self.num_stages, self.placement)

    def block_owner(self, index: int) -> int:
        return next(s for s, r in enumerate(self.stage_blocks) if index in r)

    def module_stages(self) -> dict[str, int]:
        """Every partitioned module name mapped to the stage that owns it."""
        owners = {name: 0 for name in self.pre}
        owners.update({name: self.num_stages - 1 for name in self.post})
        for stage, blocks in enumerate(self.stage_blocks):
            owners.update({f"{self.blocks_path}.{i}": stage for i in blocks})
        return owners


def plan_stages(
    module: nn.Module, ranks: int, virtual_stages: int = 1, blocks: str | None = None, layout: list[int] | None = None,
    order: RunOrder | None = None, placement: str = "loop",
) -> StagePlan:
    """Split ``module`` into ``ranks x virtual_stages`` stages placed by ``placement``; ``order`` says where
    the outer modules run."""
    check_placement(placement, ranks, ranks * virtual_stages)
    path, block_list = find_blocks(module, blocks)
    pre, post = (order.pre, order.post) if order is not None else outer_modules(module, path)
    parts = ranks * virtual_stages
    n = len(block_list)
    if layout is not None:
        if len(layout) != parts or sum(layout) != n or min(layout) < 1:
            raise PipelineConfigError(
                f"pipeline_layout {list(layout)} must give {parts} stages (pipeline_parallel x virtual_stages) "
                f"of at least one block each, summing to the model's {n} blocks; e.g. {balance([1] * n, parts)}"
                if parts <= n else f"pipeline_layout needs at least {parts} blocks, the model has {n}"
            )
        sizes = list(layout)
    else:
        def count(names):
            return sum(p.numel() for p in {id(p): p for nm in names for p in module.get_submodule(nm).parameters()}.values())

        sizes = balance([count([f"{path}.{i}"]) for i in range(n)], parts, count(pre), count(post))
    starts = [sum(sizes[:s]) for s in range(parts)]
    stage_blocks = tuple(range(a, a + size) for a, size in zip(starts, sizes))
    assigned = sorted(i for r in stage_blocks for i in r)
    assert assigned == list(range(n)), f"blocks assigned {assigned}, expected each of 0..{n - 1} exactly once"
    return StagePlan(path, stage_blocks, tuple(pre), tuple(post), ranks, order is not None, placement)


def shared_parameters(module: nn.Module, plan: StagePlan) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters held by more than one rank: ``(name, sorted ranks)``, in ``named_parameters`` order.

    A parameter belongs to every rank that owns a module using it (tied embedding and head sit on
    the first and last rank); parameters directly on a container outside any partitioned module
    stay on every rank.
    """
    owners = plan.module_stages()
    ranks_of: dict[int, set[int]] = {}
    names: dict[int, str] = {}
    for module_name, stage in owners.items():
        for p in module.get_submodule(module_name).parameters():
            ranks_of.setdefault(id(p), set()).add(plan.rank_of_stage(stage))
    for name, p in module.named_parameters(remove_duplicate=True):
        names[id(p)] = name
        ranks_of.setdefault(id(p), set(range(plan.ranks)))
    return [(names[i], tuple(sorted(r))) for i, r in ranks_of.items() if len(r) > 1 and i in names]
