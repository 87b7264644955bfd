"""Rank the layouts that fit and say why the first one wins.

Layouts are compared by predicted time per sequence (step time over the sequences of one step), so
a search over a fixed global batch (``lp-plan --search``) and one over a fixed batch per replica
(``strategy=auto``, where more replicas read more sequences) rank alike. Equal predicted times go
to the simpler layout: no activation checkpointing, no ZeRO, less memory, smaller TP, then smaller
PP. Activation checkpointing always costs time, so it is chosen only where memory needs it; ZeRO-1
moves the same bytes and shortens the optimizer step, so it wins wherever there are replicas.
Everything is pure arithmetic on the inputs, so every rank of a job that runs it gets the same
answer without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from torch import nn

from lightning_parallel.errors import LaunchError
from lightning_parallel.planner.cost import Prediction, StageWork, predict, stage_work
from lightning_parallel.planner.profile import ModelProfile
from lightning_parallel.planner.space import (
    Candidate,
    Cluster,
    Constraints,
    Workload,
    enumerate_layouts,
)

GIB = 1024**3


class PlanError(LaunchError):
    """No layout can train the model on the cluster; the message says what would."""


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    prediction: Prediction

    @property
    def sequences(self) -> int:
        return self.candidate.replica_batch * self.candidate.layout.dp

    @property
    def time_per_sequence(self) -> float:
        return self.prediction.step_time / self.sequences

    def sort_key(self) -> tuple:
        lay = self.candidate.layout
        return (self.time_per_sequence, lay.recompute, lay.zero, self.candidate.peak_bytes, lay.tp, lay.pp,
                lay.virtual_stages, lay.schedule or "", lay.micro_batches)


@dataclass(frozen=True)
class SearchResult:
    ranked: list[Ranked]  # every layout that fits, best first
    too_big: list[Candidate]  # layouts whose busiest device does not fit
    cluster: Cluster
    profile: Optional[ModelProfile] = None  # the model's costs the layouts were ranked by

    @property
    def nothing_to_choose(self) -> bool:
        """Whether every layout that fits is plain data parallelism (one process, or a model that splits no other
        way here): the search then only picks among ZeRO stages."""
        return all(r.candidate.layout.tp == r.candidate.layout.pp == r.candidate.layout.cp == 1 for r in self.ranked)

    @property
    def best(self) -> Ranked:
        return self.ranked[0]


def search(model: nn.Module, cluster: Cluster, work: Workload, fixed: Constraints = Constraints(),
           profile: Optional[ModelProfile] = None) -> SearchResult:
    """Every layout of ``cluster`` for ``model`` that fits device memory, ranked (see module docstring);
    ``profile``: the model's costs, by default ``work.profile_of(model)``."""
    profile = profile or work.profile_of(model)
    candidates = enumerate_layouts(model, cluster, work, fixed, profile)
    fits = [c for c in candidates if c.peak_bytes <= cluster.device_memory]
    too_big = [c for c in candidates if c.peak_bytes > cluster.device_memory]
    if not fits:
        raise PlanError(_nothing_fits(model, cluster, work, too_big, profile))
    asked: dict[int, StageWork] = {}  # per split (candidates of one split share its StagePlan)
    for c in fits:
        if id(c.stages) not in asked:
            asked[id(c.stages)] = stage_work(model, c.stages, profile)
    ranked = [Ranked(c, predict(c, asked[id(c.stages)], profile, cluster, work.seq, work.precision)) for c in fits]
    return SearchResult(sorted(ranked, key=Ranked.sort_key), too_big, cluster, profile)


def _nothing_fits(model: nn.Module, cluster: Cluster, work: Workload, too_big: list[Candidate],
                  profile: ModelProfile) -> str:
    head = (f"no layout of {type(model).__name__} fits {cluster.nodes} node(s) x {cluster.devices_per_node} "
            f"devices of {cluster.device_memory / GIB:.1f} GiB")
    if not too_big:
        return (f"{head}: the model splits into no layout of this world (TP sizes must divide the devices per "
                f"node and the heads, PP sizes the blocks, and the batch the DP size)")
    least = min(too_big, key=lambda c: c.peak_bytes)
    needed = least.peak_bytes
    nodes = _nodes_that_fit(model, cluster, work, profile)
    more = (f"; with {nodes} nodes of these devices it fits" if nodes else "")
    return (f"{head}. The smallest, {least.layout.describe()}, needs {needed / GIB:.1f} GiB per device "
            f"(estimate.py). Use devices with at least {needed / GIB:.1f} GiB{more}, or a smaller batch per "
            f"replica or sequence length.")


def _nodes_that_fit(model: nn.Module, cluster: Cluster, work: Workload, profile: ModelProfile,
                    doublings: int = 3) -> int | None:
    """The fewest nodes (doubling up to 8x) on which some layout fits, or None."""
    nodes = cluster.nodes
    for _ in range(doublings):
        nodes *= 2
        bigger = replace(cluster, nodes=nodes)
        if any(c.peak_bytes <= cluster.device_memory for c in enumerate_layouts(model, bigger, work, profile=profile)):
            return nodes
    return None


# ---- reports ---------------------------------------------------------------------------------
def _seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def format_table(result: SearchResult, top: int = 5) -> str:
    """The best ``top`` layouts, one a line: memory per device, step time, bubble, bytes moved."""
    header = (f"{'#':>2}  {'layout':<44} {'batch':>9} {'memory/device':>13} {'step time':>10} "
              f"{'per seq':>9} {'bubble':>7} {'moved/device':>13}")
    lines = [header]
    for i, r in enumerate(result.ranked[:top], 1):
        c, p = r.candidate, r.prediction
        batch = f"{c.layout.dp}x{c.replica_batch}"
        lines.append(f"{i:>2}  {c.layout.describe():<44} {batch:>9} {_bytes(c.peak_bytes):>13} "
                     f"{_seconds(p.step_time):>10} {_seconds(r.time_per_sequence):>9} {p.bubble:>6.1%} "
                     f"{_bytes(p.bytes_moved):>13}")
    return "\n".join(lines)


_PARTS = (("compute", "compute"), ("tensor_parallel", "TP all-reduces"), ("point_to_point", "stage-to-stage sends"),
          ("context_parallel", "ring attention exchanges"), ("idle", "pipeline bubble"),
          ("data_parallel", "DP all-reduce"), ("optimizer", "optimizer step"))


def explain(result: SearchResult) -> str:
    """Why the best layout wins: its time split, then what costs the next different sizes more."""
    best = result.best
    p = best.prediction
    split = ", ".join(f"{label} {_seconds(getattr(p, name))}" for name, label in _PARTS if getattr(p, name) > 0)
    lines = [f"chosen: {best.candidate.layout.describe()}: {_seconds(p.step_time)} per step of "
             f"{best.sequences} sequences ({split})"]
    seen = {_sizes(best)}
    for other in result.ranked[1:]:
        if _sizes(other) in seen or len(seen) > 3:
            continue
        seen.add(_sizes(other))
        scale = best.sequences / other.sequences  # compare per sequence, on the best one's batch
        deltas = {label: getattr(other.prediction, name) * scale - getattr(p, name) for name, label in _PARTS}
        worst = max(deltas, key=deltas.get)
        slower = other.time_per_sequence / best.time_per_sequence - 1
        lines.append(f"  vs {other.candidate.layout.describe()}: {slower:+.0%} per sequence, mostly "
                     f"{worst} ({_seconds(deltas[worst])} more per step)")
    if result.too_big:
        least = min(result.too_big, key=lambda c: c.peak_bytes)
        biggest = max(result.too_big, key=lambda c: c.peak_bytes)
        lines.append(f"  {len(result.too_big)} layouts do not fit {result.cluster.device_memory / GIB:.1f} GiB per "
                     f"device (from {_bytes(least.peak_bytes)} to {_bytes(biggest.peak_bytes)})")
    return "\n".join(lines)


def _sizes(r: Ranked) -> tuple[int, int, int, int]:
    return r.candidate.layout.tp, r.candidate.layout.pp, r.candidate.layout.dp, r.candidate.layout.cp
