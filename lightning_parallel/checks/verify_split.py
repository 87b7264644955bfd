"""Check a tensor-parallel split against the whole model by construction, before training.

A plan can fit every size and the split model can run, yet compute something else: an attention
that reshapes with a hard-coded head count regroups its heads once they are split, a norm over an
MLP's hidden features normalises each rank's half, a fused layout the plan describes wrongly mixes
q, k and v. Comparing the loss at initialisation cannot see the first (a near-uniform attention
hides the regrouping: a test loss moved by 6e-5), and a model trains from it silently wrong.

So, every rank runs one unit of each kind (``split_units.py``: a block, the embedding, the
head) both ways on one micro-batch, in float64 (``float64.py``): the split unit as it will train
(this rank's shards, the real tensor-parallel collectives) and a whole copy of it, taken before the
split and given the full values of the same parameters (the shards gathered over the TP group), on
the CPU. Both receive the inputs the unit received in the first step on the split model (run in eval
mode: dropout off), and the same random output gradient. Their outputs, the gradients
of their inputs and the gradients of every parameter (the whole one's sliced as the split one is
sharded) must agree to float64 rounding (``split_compare.py``); otherwise every rank refuses the
split with the unit, the value and the parameter that differ. The cost does not grow with depth:
one block of each kind runs.

The inputs come from the run's first real step (``first_step.py``), so the user's step runs no extra
time. Two layouts check at setup instead, on one run of the step forward only
(``check_split_against_whole``): under pipeline parallelism each stage checks the units it holds,
running its part of the step (``PipelineEngine.run_stages``, the stages being cut on a traced run
already), and under ZeRO-2/3 the check runs before the parameters are sharded over the replicas.
What it does not cover: code outside the units (the user's loss reads whole, gathered logits), and
training-only paths of a unit (eval mode).
"""

from __future__ import annotations

import hashlib
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_parallel.checks.model import tp_assignments
from lightning_parallel.compat import tree_map
from lightning_parallel.errors import LaunchError
from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.example import first_batch
from lightning_parallel.pipeline.isolation import untouched
from lightning_parallel.pipeline.logs import LogCapture
from lightning_parallel.pipeline.microbatch import batch_size, split_batch
from lightning_parallel.pipeline.stage_modules import called_directly
from lightning_parallel.tensor_parallel.comm import SEQ_DIM
from lightning_parallel.tensor_parallel.shard import (
    TPShard,
    gather_full_tensor,
    merge_shards,
    slice_shard,
)

from .split_compare import Difference, compare, magnitude
from .split_run import Captured, Float64Run, capture_inputs
from .split_units import Unit, choose_units


@dataclass
class Verification:
    """What the check compared on this rank, and what it cost."""

    units: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes: int = 0  # the check's own tensors at their peak: whole and split values, gradients, inputs
    closest: float = 0.0  # the largest difference float64 rounding explained, relative to its scale

    def describe(self) -> str:
        done = f"{len(self.units)} module kind(s) ({', '.join(self.units)})" if self.units else "no module"
        skipped = f"; not compared: {', '.join(self.skipped)}" if self.skipped else ""
        return (f"split checked against the whole model in float64: {done} in {self.seconds:.1f} s, "
                f"{self.bytes / 2**20:.1f} MiB; largest difference {self.closest:.0e} of scale{skipped}")


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**62 - 1)


class SplitChecker:
    """Prepared before the split (``units``: whole copies), run after it (``run``) on every rank."""

    def __init__(self, units: list[Unit], mesh, sequence_parallel: bool) -> None:
        self.units, self.mesh, self.sequence_parallel = units, mesh, sequence_parallel
        self.nbytes = 0  # the largest one comparison took

    # ---- values --------------------------------------------------------------------------------
    def _whole_values(self, split: nn.Module, unit: Unit) -> Optional[dict[str, torch.Tensor]]:
        """Full float64 CPU values of the whole copy's parameters, gathered from the split unit's
        shards (a collective over TP), and its buffers (floating ones in float64) on the CPU; None if a
        parameter has no match."""
        held = dict(split.named_parameters(remove_duplicate=False))
        values: dict[str, torch.Tensor] = {}
        for name, p in unit.whole.named_parameters(remove_duplicate=False):
            source = held.get(name)
            if source is None or source.is_meta:
                return None
            shard = getattr(source, "tp_shard", None)
            full = gather_full_tensor(source, shard, self.mesh) if shard is not None else source.detach()
            values[name] = full.to("cpu", torch.float64)
        for name, b in unit.whole.named_buffers():
            values[name] = b.detach().to("cpu", torch.float64) if b.is_floating_point() else b.detach().to("cpu")
        return values

    @staticmethod
    def _split_values(split: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        values = {n: p.detach().to(device, torch.float64) for n, p in split.named_parameters(remove_duplicate=False)}
        values.update({n: b.detach().to(device, torch.float64) for n, b in split.named_buffers()
                       if b.is_floating_point()})
        return values

    def _whole_input(self, captured: Captured) -> Captured:
        """Sequence parallelism: the unit's first floating input is this rank's part of the sequence;
        the whole unit takes the whole sequence."""
        if not self.sequence_parallel:
            return captured
        done = []

        def gather(value: Any) -> Any:
            if not done and isinstance(value, torch.Tensor) and value.is_floating_point():
                done.append(True)
                whole = _gather(value, SEQ_DIM, self.mesh)
                whole.needs_grad = getattr(value, "needs_grad", False)
                return whole
            return value

        args, kwargs = tree_map(gather, (captured.args, captured.kwargs))
        return Captured(args, kwargs)

    def _layout(self, local: Optional[torch.Tensor], whole: Optional[torch.Tensor], fused: int) -> Optional[TPShard]:
        """How a split side's tensor holds this rank's part of the whole side's: along the one dimension
        where they differ (vocabulary-parallel logits, a column-parallel layer's features in ``fused``
        blocks, a sequence part); None where it is whole (or no such part)."""
        if local is None or whole is None or local.shape == whole.shape or local.dim() != whole.dim():
            return None
        dims = [d for d in range(local.dim()) if local.shape[d] != whole.shape[d]]
        if len(dims) != 1 or local.shape[dims[0]] * self.mesh.tp_size < whole.shape[dims[0]]:
            return None
        d = dims[0]
        padded = local.shape[d] * self.mesh.tp_size != whole.shape[d]
        return TPShard(dim=d, fused=fused, full_size=whole.shape[d] if padded else None)

    def _to_whole(self, got: Optional[torch.Tensor], like: Optional[torch.Tensor], fused: int = 1):
        """A split side's tensor laid out as the whole side's (gathered over TP where it holds a part)."""
        layout = self._layout(got, like, fused)
        if layout is None:
            return got
        parts = [torch.empty_like(got) for _ in range(self.mesh.tp_size)]
        dist.all_gather(parts, got.contiguous(), group=self.mesh.tp_group)
        return merge_shards(parts, layout)

    def _part(self, cotangent: torch.Tensor, local: torch.Tensor, fused: int = 1) -> torch.Tensor:
        """This rank's part of a whole output's cotangent, for an output held in parts."""
        layout = self._layout(local, cotangent, fused)
        return cotangent if layout is None else slice_shard(cotangent, layout, self.mesh.tp_rank, self.mesh.tp_size)

    # ---- one module ------------------------------------------------------------------------------
    def compare(self, split: nn.Module, whole: nn.Module, values: tuple[dict, dict], captured: Captured,
                device: torch.device, seed: int) -> list[Difference]:
        """The differences between ``split`` and ``whole`` run on ``captured`` (``values``: the whole and
        the split side's parameters and buffers by name), in order (outputs, input gradients, parameter
        gradients), up to the first one float64 rounding does not explain."""
        whole_values, split_values = values
        params = {n for n, p in whole.named_parameters(remove_duplicate=False) if p.requires_grad}
        whole_side = Float64Run(whole, _needing_grad(whole_values, params), self._whole_input(captured),
                           torch.device("cpu"))
        with called_directly(split):  # a pipeline stage's block runs its own forward, not the stage's dispatch
            part = Float64Run(split, _needing_grad(split_values, params), captured, device)
        self.nbytes = max(self.nbytes, whole_side.nbytes() + part.nbytes())
        if len(part.outputs) != len(whole_side.outputs):
            return [Difference(f"its output ({len(part.outputs)} floating tensors instead of "
                               f"{len(whole_side.outputs)})", float("inf"), 1.0)]
        found: list[Difference] = []
        shard = getattr(getattr(split, "weight", None), "tp_shard", None)  # a split layer's output blocks
        fused = shard.fused if shard is not None else 1
        scale = max(map(magnitude, whole_side.outputs), default=0.0)
        for i, (got, want) in enumerate(zip(part.outputs, whole_side.outputs)):
            found.append(compare(f"its output{f' {i}' if len(whole_side.outputs) > 1 else ''}",
                                 self._to_whole(got.detach(), want, fused), want, scale))
            if not found[-1].rounding:
                return found
        generator = torch.Generator().manual_seed(seed)
        cotangents = [torch.randn(o.shape, generator=generator, dtype=torch.float64) if o.requires_grad else None
                      for o in whole_side.outputs]
        whole_grads = whole_side.backward(cotangents)
        part_grads = part.backward([None if c is None else self._part(c, o, fused).to(device)
                                    for c, o in zip(cotangents, part.outputs)])
        scale = max((magnitude(whole_grads.get(path)) for path, _ in whole_side.inputs), default=0.0)
        for path, _ in whole_side.inputs:
            want = whole_grads.get(path)
            found.append(compare(f"the gradient of its {path}", self._to_whole(part_grads.get(path), want), want, scale))
            if not found[-1].rounding:
                return found
        scale = max((magnitude(whole_grads.get(n)) for n in whole_side.params), default=0.0)
        held = dict(split.named_parameters(remove_duplicate=False))
        for name in whole_side.params:
            got, want = part_grads.get(name), whole_grads.get(name)
            shard = getattr(held[name], "tp_shard", None)
            if shard is not None and want is not None:
                want = slice_shard(want, shard, self.mesh.tp_rank, self.mesh.tp_size)
            if got is not None and getattr(held[name], "sequence_parallel", False):
                dist.all_reduce(got, group=self.mesh.tp_group)  # summed over TP after backward, as in training
            found.append(compare(f"the gradient of {name}", got, want, scale))
            if not found[-1].rounding:
                return found
        return found

    def compare_unit(self, root: nn.Module, unit: Unit, captured: dict[str, Captured],
                     device: torch.device) -> tuple[str, list[Difference]]:
        """The differences of ``unit`` (see ``compare``); where it differs, those of the innermost of its
        parts that differs too, with that part's name (the unit's where none does). Empty where the unit
        cannot be compared (a parameter with no counterpart, a buffer without values)."""
        split = root.get_submodule(unit.name)
        whole_values = self._whole_values(split, unit)
        if whole_values is None:
            return unit.name, []
        split_values = self._split_values(split, device)
        found = self.compare(split, unit.whole, (whole_values, split_values), captured[unit.name], device,
                             _seed(unit.name))
        if not found or found[-1].rounding:
            return unit.name, found
        where, differences = unit.name, found
        for part in unit.parts:  # outermost first: a part inside a culprit found later is more precise
            name = f"{unit.name}.{part}" if unit.name else part
            inside_culprit = where == unit.name or name.startswith(where + ".")
            if not inside_culprit or name not in captured:
                continue
            try:
                part_found = self.compare(split.get_submodule(part), unit.whole.get_submodule(part),
                                          (_inside(whole_values, part), _inside(split_values, part)), captured[name],
                                          device, _seed(name))
            except Exception:  # noqa: BLE001 - a part that cannot run alone (its input is split) tells nothing
                continue
            if part_found and not part_found[-1].rounding and "has shape" not in part_found[-1].what:
                where, differences = name, part_found
        return where, differences

    # ---- every unit ----------------------------------------------------------------------------
    def held(self, root: nn.Module) -> list[Unit]:
        """The units this rank holds (not a pipeline stage's stand-in in their place)."""
        return [u for u in self.units if _holds(root, u)]

    def run(self, root: nn.Module, run_step, device: torch.device) -> tuple[Verification, list[str]]:
        """Compare every unit this rank holds on the inputs one ``run_step()`` (in eval mode) gives them;
        (what was done, the differences found, as texts)."""
        held = self.held(root)
        with _eval_mode([root]), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            captured = capture_inputs(root, [n for u in held for n in u.part_names()], run_step)
        return self.compare_captured(root, held, captured, device)

    def compare_captured(self, root: nn.Module, held: list[Unit], captured: dict[str, Captured],
                         device: torch.device) -> tuple[Verification, list[str]]:
        """Compare the ``held`` units on the ``captured`` inputs, in eval mode, leaving the random number
        generators as they were; (what was done, the differences found, as texts)."""
        start = time.perf_counter()
        with _eval_mode([root] + [u.whole for u in held]), \
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            report, found = self._compare_all(root, held, captured, device)
        report.bytes, report.seconds = self.nbytes, time.perf_counter() - start
        return report, found

    def _compare_all(self, root: nn.Module, held: list[Unit], captured: dict[str, Captured],
                     device: torch.device) -> tuple[Verification, list[str]]:
        report, found = Verification(), []
        for unit in held:
            if unit.name not in captured:
                report.skipped.append(f"{unit.name} (not called by the step)")
                continue
            try:
                where, differences = self.compare_unit(root, unit, captured, device)
            except Exception as err:  # noqa: BLE001 - the same on every TP rank: the unit's code, not the split
                report.skipped.append(f"{unit.name} ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
                continue
            if not differences:
                report.skipped.append(f"{unit.name} (no values to compare)")
                continue
            report.units.append(unit.name or type(root).__name__)
            report.closest = max([report.closest] + [d.relative for d in differences if d.rounding])
            if not differences[-1].rounding:
                kind = type(root.get_submodule(where)).__name__
                found.append(f"{where or 'the module'} ({kind}): {differences[-1].describe()}")
        return report, found


def _inside(values: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The values of the tensors of submodule ``part``, named relative to it."""
    return {n[len(part) + 1:]: v for n, v in values.items() if n.startswith(part + ".")}


def _needing_grad(values: dict[str, torch.Tensor], params: set[str]) -> dict[str, torch.Tensor]:
    """``values`` with fresh leaves for the parameters that train (gradients wanted)."""
    return {n: v.detach().requires_grad_(True) if n in params else v for n, v in values.items()}


def _holds(root: nn.Module, unit: Unit) -> bool:
    """Whether this rank holds ``unit``, not a pipeline stage's weightless stand-in in its place."""
    try:
        module = root.get_submodule(unit.name)
    except AttributeError:
        return False
    params = dict(module.named_parameters(remove_duplicate=False))
    return params.keys() == dict(unit.whole.named_parameters(remove_duplicate=False)).keys() and \
        not any(p.is_meta for p in params.values())


def _gather(tensor: torch.Tensor, dim: int, mesh) -> torch.Tensor:
    """Every TP rank's ``tensor`` concatenated along ``dim`` (rank order)."""
    parts = [torch.empty_like(tensor) for _ in range(mesh.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=mesh.tp_group)
    return torch.cat(parts, dim=dim)


def _every_block(name: str) -> str:
    """``model.layers.0.self_attn`` -> ``model.layers.*.self_attn``: the module in every block."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


@contextmanager
def _eval_mode(modules: list[nn.Module]) -> Iterator[None]:
    """Inside, ``modules`` are in eval mode (dropout off); on exit each submodule has its mode back."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def small_example(batch: Any) -> Any:
    """The first two samples of ``batch`` (one if it holds one; two, because batch norm in training mode
    refuses a single one); the whole batch if it holds no tensor."""
    try:
        return split_batch(batch, max(1, batch_size(batch) // 2))[0][0]
    except PipelineConfigError:
        return batch


def step_runner(module: nn.Module, step: str, example: Any, pipeline=None):
    """A callable running ``module``'s ``step`` once on ``example``, leaving nothing behind; under pipeline
    parallelism, this rank's stages of it (``PipelineEngine.run_stages``)."""
    def run() -> None:
        if pipeline is not None:
            pipeline.run_stages(example, step)
            return
        with untouched(module), LogCapture(module).suppressed():
            getattr(module, step)(example, 0)
    return run


# ---- the strategy's entry points ---------------------------------------------------------------------
def prepare_split_check(module: nn.Module, mesh, options) -> SplitChecker:
    """Before the split: the units to check and their whole copies (``options``: the strategy's
    ``ParallelOptions``; the plan resolved as ``parallelize`` will resolve it)."""
    assignments = tp_assignments(module, mesh.tp_size, options.tp_plan, options.sequence_parallel)
    return SplitChecker(choose_units(module, assignments), mesh, options.sequence_parallel)


def check_split_against_whole(strategy: Any, trainer: Any, checker: SplitChecker) -> Optional[Verification]:
    """Run ``checker`` at setup on one forward of the step the Trainer is about to run, and refuse, on every
    rank alike, a split that computes other values (all ranks call it). For the layouts that cannot check
    in the first step (the module docstring); None where the check cannot run: no data, or manual
    optimisation (its step steps optimizers itself)."""
    module = strategy.lightning_module
    if trainer is None or trainer.state.fn not in (TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING):
        return None
    if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
        return None
    batch, step = first_batch(trainer, strategy)  # a pipeline runs the micro-batch it traced; otherwise two samples do
    example = batch if batch is None or strategy.pipeline is not None else small_example(batch)
    if example is None:
        return None
    device = strategy.root_device
    report, found = checker.run(module, step_runner(module, step, move_data_to_device(example, device),
                                                    strategy.pipeline), device)
    refuse_differences(found, strategy.options.tp)
    return report


def refuse_differences(found: list[str], tp: int) -> None:
    """Raise the same ``LaunchError`` on every rank if any rank ``found`` a difference (all ranks call it:
    one collective)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    failed = [(rank, texts[0]) for rank, texts in enumerate(every) if texts]
    if failed:
        rank, first = failed[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        raise LaunchError(
            f"with tensor_parallel={tp}, the split model computes other values than the "
            f"whole one: on rank{'s' if len(failed) > 1 else ''} {ranks}, {first}. Found on the first batch, before "
            "any parameter changed, by running that module whole and split in float64 (outputs and gradients); "
            "unchecked, the model would train silently wrong. Likely code in that module that uses a split layer's "
            "output as if it were whole (a reshape with a hard-coded head count, a norm or softmax over split "
            "features) or a plan entry that does not describe the module's layout (a fused q/k/v split as three "
            f"equal blocks). To train this model, give strategy.tp_plan a plan that leaves "
            f"{_every_block(first.split(' ')[0])} whole (no entry for it or anything inside it), or train with "
            "tensor_parallel=1. ParallelStrategy(verify_split=False) skips this check."
        )
