"""The layouts a model can run on an allocation: the only ones a refusal suggests.

A refused launch is answered with layouts that pass every check of a launch for this model
(``Launch.passes``: the layout on the allocation, the training mode, the model's split): TP sizes
that divide its heads, KV heads, experts and vocabulary as its plan splits them, pipeline sizes
within its blocks, on the nodes the allocation has (a one-machine run is never told to use two).
``layout_fixes`` lists them nearest to what was asked first: other sizes on the same processes, then
the asked sizes (or the nearest the model runs) on other device counts per node. A refusal's own
fixes are kept only where they pass too (``checked_fixes``), so a script is told only arguments that
work as written. Pure: the checks read module shapes, on the meta device or not; no process starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Optional

from torch import nn

from lightning_parallel.checks.launch import check_layout
from lightning_parallel.checks.model import check_model, check_training_mode
from lightning_parallel.errors import Fix, LaunchError, LightningParallelError, lead_in_dropped
from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.options import AUTO, ParallelOptions
from lightning_parallel.tensor_parallel.resolve import divisors

# fixes of each kind a refusal lists: on the same processes, and on other device counts
PER_KIND = 3


@dataclass(frozen=True)
class Launch:
    """One launch as the checks see it: the model, its options and the allocation."""

    model: nn.Module
    options: ParallelOptions
    num_nodes: int
    devices_per_node: int
    automatic_optimization: bool = True
    loss_scaler: bool = False
    # the model's verdict per split (options but the DP size, which changes only the world it is checked on),
    # shared by the launches ``with_fix`` derives: each TP and PP size of a model is checked once
    verdicts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def world(self) -> int:
        return self.num_nodes * self.devices_per_node

    def check_layout_only(self) -> ParallelMesh:
        return check_layout(self.options, self.num_nodes, self.devices_per_node)

    def check(self) -> ParallelMesh:
        """Every check of a launch with a model (``checks.launch.validate_launch`` without the SLURM one)."""
        mesh = self.check_layout_only()
        check_training_mode(self.model, mesh.pp_size, self.automatic_optimization, self.loss_scaler)
        split = repr(self.options.replace(data_parallel=AUTO))
        if split not in self.verdicts:
            try:
                check_model(self.model, mesh, self.options)
                self.verdicts[split] = None
            except (LightningParallelError, ValueError) as err:
                self.verdicts[split] = err
        if self.verdicts[split] is not None:
            raise self.verdicts[split]
        return mesh

    def passes(self) -> bool:
        try:
            self.check()
        except (LightningParallelError, ValueError):
            return False
        return True

    def with_fix(self, fix: Fix) -> Optional["Launch"]:
        """This launch with ``fix`` applied; None where the fix names a setting outside the layout and the
        allocation (``data.batch_size``, ``trainer.precision``), which these checks cannot try."""
        sizes, nodes, devices = {}, self.num_nodes, self.devices_per_node
        for key, value in fix.settings.items():
            owner, _, name = key.partition(".")
            if key == "trainer.num_nodes":
                nodes = int(value)
            elif key == "trainer.devices":
                devices = int(value)
            elif owner == "strategy" and name in ParallelOptions.__dataclass_fields__:
                sizes[name] = value
            else:
                return None
        return replace(self, options=self.options.replace(**sizes), num_nodes=nodes, devices_per_node=devices)

    def fix_passes(self, fix: Fix) -> bool:
        """Whether the launch ``fix`` makes passes; a fix these checks cannot try counts as passing."""
        try:
            fixed = self.with_fix(fix)
        except (LightningParallelError, ValueError):  # sizes the options refuse
            return False
        return fixed is None or fixed.passes()


def checked_layout(launch: Launch) -> ParallelMesh:
    """``check_layout`` of the launch, the refusal listing only layouts the model runs; where the model does
    not split into the asked sizes on any allocation, the model's own refusal ("4 attention heads") first."""
    options = launch.options
    try:
        return check_layout(options, launch.num_nodes, launch.devices_per_node,
                            runs=lambda tp, pp: splits(launch, tp, pp))
    except LaunchError:
        if splits(launch, options.tp, options.pp):
            raise
        alone = launch.with_fix(_alone(launch, options.tp, options.pp))
        try:
            check_training_mode(launch.model, options.pp, launch.automatic_optimization, launch.loss_scaler)
            check_model(launch.model, alone.check_layout_only(), options)
        except LaunchError as err:  # its fixes were for the processes the sizes alone need: the layouts follow
            raise type(err)(err.problem) from None
        raise


def _nearest(values: Iterable[int], target: int) -> list[int]:
    """``values`` nearest to ``target`` first, the smaller of two alike (less communication)."""
    return sorted(values, key=lambda v: (abs(v - target), v))


def _sizes(launch: Launch, tp: int, pp: int, world: int) -> dict[str, int]:
    """The strategy settings of the layout ``tp`` x ``pp`` on ``world`` processes that differ from the launch's
    (``data_parallel`` only where it was given as a number: "auto" takes the rest by itself)."""
    options = launch.options
    settings = {}
    if tp != options.tp:
        settings["strategy.tensor_parallel"] = tp
    if pp != options.pp:
        settings["strategy.pipeline_parallel"] = pp
    if options.data_parallel != AUTO:
        dp = world // (tp * pp * options.cp)
        if dp != options.data_parallel:
            settings["strategy.data_parallel"] = dp
    return settings


def _alone(launch: Launch, tp: int, pp: int) -> Fix:
    """``tp`` x ``pp`` (with the launch's CP and EP sizes) on one node of just the processes it needs."""
    options = launch.options
    return Fix({"strategy.tensor_parallel": tp, "strategy.pipeline_parallel": pp, "strategy.data_parallel": options.ep,
                "trainer.num_nodes": 1, "trainer.devices": tp * pp * options.cp * options.ep})


def splits(launch: Launch, tp: int, pp: int) -> bool:
    """Whether the model splits into ``tp`` x ``pp`` (with the launch's CP and EP sizes), checked on one node
    of just the processes that layout needs: what a model runs does not depend on the allocation."""
    return launch.fix_passes(_alone(launch, tp, pp))


def same_processes(launch: Launch) -> list[Fix]:
    """Other layouts of the launch's processes that the model runs, nearest to the asked sizes first."""
    options, world = launch.options, launch.world
    fixes = []
    for tp in _nearest(divisors(launch.devices_per_node), options.tp):
        for pp in _nearest(divisors(world // tp), options.pp):
            fix = Fix(_sizes(launch, tp, pp, world), f"keep {launch.num_nodes} node(s) x {launch.devices_per_node} devices")
            if fix.settings and world % (tp * pp * options.cp) == 0 and launch.fix_passes(fix):
                fixes.append(fix)
    return fixes[:PER_KIND]


def other_devices(launch: Launch) -> list[Fix]:
    """The asked TP and PP sizes, or the nearest ones the model runs, on the nearest device counts per node
    below and above the launch's that fit them (the nodes stay those the allocation has)."""
    options, nodes, devices = launch.options, launch.num_nodes, launch.devices_per_node
    tp, pp, cp = options.tp, options.pp, options.cp
    fixes: list[Fix] = []
    pairs = sorted(((t, p) for t in range(1, 2 * max(tp, devices) + 1) for p in range(1, pp + 1)),
                   key=lambda tp_pp: (abs(tp_pp[0] - tp) + abs(tp_pp[1] - pp), tp_pp))
    for t, p in pairs:
        if t * p == 1 < tp * pp:  # no split runs on the launch's own processes (same_processes)
            continue
        per_node = [d for d in range(1, 2 * max(devices, t * p * cp) + 1)
                    if d != devices and d % t == 0 and (nodes * d) % (t * p * cp) == 0]
        below = [d for d in per_node if d < devices][-1:]
        above = [d for d in per_node if d > devices][:1]
        kept = " ".join(f"{name}={v}" for name, v in (("tensor_parallel", t), ("pipeline_parallel", p)) if v > 1)
        for d in below + above:
            fix = Fix({**_sizes(launch, t, p, nodes * d), "trainer.devices": d}, f"keep {kept or 'no model split'}")
            if launch.fix_passes(fix):
                fixes.append(fix)
        if len(fixes) >= PER_KIND:
            break
    return fixes[:PER_KIND]


def layout_fixes(launch: Launch) -> list[Fix]:
    """Layouts the model runs: on the launch's processes first, then on other device counts per node."""
    return same_processes(launch) + other_devices(launch)


def checked_fixes(launch: Launch, err: LaunchError) -> list[Fix]:
    """``err``'s fixes that pass (or name settings the checks cannot try), then, where the sizes are what does
    not fit (``MeshError``), the layouts the model runs; each setting once."""
    kept, seen = [], set()
    for fix in [*err.fixes, *(layout_fixes(launch) if isinstance(err, MeshError) else [])]:
        key = tuple(sorted(fix.settings.items(), key=lambda kv: kv[0]))
        if key not in seen and launch.fix_passes(fix):
            seen.add(key)
            kept.append(fix)
    return kept


def with_runnable_fixes(err: LaunchError, launch: Launch) -> LaunchError:
    """``err`` with only the fixes ``launch``'s model runs, and the layouts it runs where the sizes do not fit;
    a ``MeshError`` is given to the user as the ``LaunchError`` it is."""
    fixes = checked_fixes(launch, err)
    refusal = LaunchError if isinstance(err, MeshError) else type(err)
    return refusal(err.problem if fixes else lead_in_dropped(err.problem), fixes)
