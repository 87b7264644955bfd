"""Run the user's step once on the split model at setup, so a model that TP breaks is refused there.

The plan checks (``resolve.py``, ``shapes.py``) see module types and sizes, not the code of a
model's ``forward``. Some forwards only break once their layers hold shards: Doge's own Hugging Face
plan makes ``dt_proj`` rowwise while its output is then used per local head; BigBird rebuilds its
attention for short sequences; a hand-written module reshapes with a hard-coded full width. Without
a check they fail in the first forward of the first step, mid-run, possibly on one TP rank only.

``refuse_failing_split`` runs the step the Trainer is about to run (``training_step`` for ``fit``,
``validation_step`` / ``test_step`` otherwise) forward only, under ``torch.no_grad()``, on the first
two samples of the loop's first batch (``pipeline/example.py``; two, because batch norm in training
mode refuses a single one). It leaves nothing behind: random number generators, buffers, plain
module attributes and torchmetrics states (``pipeline/isolation.py``) and ``train``/``eval`` modes
are restored, and ``self.log`` records nothing (``pipeline/logs.py``).

The probe must never hang. The TP layers all-reduce inside the forward; a rank whose forward raises
before a collective leaves its peers blocked in it until the process-group timeout (measured with
gloo, two ranks: the peer waits the full timeout, then both ranks fail with different transport
errors, and a later agreement collective fails the same way). So the probe's forward runs with the
collectives replaced by local stand-ins of the same shapes (``local_collectives``): every rank
finishes its forward, failing or not, and then takes part in exactly one collective, an
``all_gather_object`` of the error texts. Every rank raises the same ``LaunchError`` from
the gathered texts, naming the exception, the innermost module running when it was raised, the
sharded layers inside that module, and what to change. Values computed with stand-ins are partial
sums, which is fine: that probe looks for errors, not for results.

A split can also run without error and compute something else: a forward that normalises, takes a
softmax or a mean over an MLP's hidden features (sharded by the column-parallel layer before it),
or reshapes with a hard-coded head count, gives each rank a partial answer that no collective
repairs, and the model trains silently wrong from its first step. So, once every rank's forward is
known to finish, ``refuse_wrong_split`` runs the same step again with the real collectives, in eval
mode (no dropout), and compares the scalars it returns and logs (the loss, logged values) with what
the whole model computed on the same samples before the split (``unsplit_values``); a difference
beyond rounding is refused on every rank. Both runs use full-precision float32 matmuls (no TF32), so a reference computed on the
CPU and a split run on a GPU agree to rounding. What a first step cannot show is not caught: an
attention reshaped with a hard-coded head count is nearly uniform at initialisation and moved a
test loss by 7e-5 only, below the tolerance. Skipped for a model built on the meta device (no values before the split), for one of
more than ``REFERENCE_LIMIT`` parameters (its whole forward would run where it was built, often
the CPU), and where the step draws random numbers in eval mode.
"""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_parallel.errors import LaunchError
from lightning_parallel.pipeline.compare import close, floating_tensors
from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.example import first_batch
from lightning_parallel.pipeline.isolation import untouched
from lightning_parallel.pipeline.logs import LogCapture
from lightning_parallel.pipeline.microbatch import batch_size, split_batch
from lightning_parallel.tensor_parallel import comm

_PROBED_STEPS = (TrainerFn.FITTING, TrainerFn.VALIDATING, TrainerFn.TESTING)
_STYLES = {"ColumnParallelLinear": "colwise", "RowParallelLinear": "rowwise", "VocabParallelEmbedding": "vocab"}


class _Done:
    """What an ``async_op=True`` collective returns: a work handle that is already complete."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _finish(kwargs: dict) -> Optional[_Done]:
    return _Done() if kwargs.get("async_op") else None


def _all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Optional[_Done]:
    return _finish(kwargs)  # this rank's own value stands for the reduction


def _all_gather_into(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Optional[_Done]:
    # (r * d0, ...) filled with r copies of this rank's (d0, ...)
    output.copy_(input.reshape(1, *input.shape).expand(output.numel() // max(input.numel(), 1), *input.shape)
                 .reshape(output.shape))
    return _finish(kwargs)


def _all_gather(outputs: list, input: torch.Tensor, *args: Any, **kwargs: Any) -> Optional[_Done]:
    for out in outputs:
        out.copy_(input)
    return _finish(kwargs)


def _reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Optional[_Done]:
    # signature (output, input, op, group, async_op): this rank's slice, unreduced
    rank = dist.get_rank(kwargs.get("group", args[1] if len(args) > 1 else None))
    output.copy_(input.reshape(-1, *output.shape)[rank])
    return _finish(kwargs)


def _no_op(*args: Any, **kwargs: Any) -> Optional[_Done]:
    return _finish(kwargs)


_STAND_INS = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into,
    "all_gather_single": _all_gather_into,
    "reduce_scatter_tensor": _reduce_scatter_into,
    "reduce_scatter_single": _reduce_scatter_into,
    "broadcast": _no_op,
    "barrier": _no_op,
}


@contextmanager
def local_collectives() -> Iterator[None]:
    """Inside, ``torch.distributed``'s collectives (and ``comm.py``'s, bound at import) communicate
    nothing: outputs take their shapes from this rank's inputs. So no rank can wait for another."""
    replaced = [(dist, name, stand_in) for name, stand_in in _STAND_INS.items() if hasattr(dist, name)]
    by_original = {getattr(dist, name): stand_in for _, name, stand_in in replaced}
    replaced += [(comm, name, by_original[value]) for name, value in vars(comm).items()
                 if callable(value) and value in by_original]  # comm.py binds some to its own names at import
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    try:
        for owner, name, stand_in in replaced:
            setattr(owner, name, stand_in)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class _RunningModules:
    """Forward hooks keeping the stack of modules whose forward is running; after an exception its
    top is the innermost module that was running when it was raised."""

    def __init__(self, root: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, m in root.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(name)))
            self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, name: str):
        def hook(_module, _args) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, _module, _args, _out) -> None:  # returns None: the output stays the module's own
        if self.stack:
            self.stack.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def small_example(batch: Any) -> Any:
    """The first two samples of ``batch`` (one if it holds one); the whole batch if it holds no tensor."""
    try:
        return split_batch(batch, max(1, batch_size(batch) // 2))[0][0]
    except PipelineConfigError:
        return batch


@contextmanager
def _modes(module: nn.Module, training: bool) -> Iterator[None]:
    """The modes the loop runs the step in (``train`` for fit), restored module by module on exit."""
    before = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, mode in before:
            m.training = mode


def _run(strategy: Any, step: str, example: Any) -> Optional[str]:
    """Run the step forward only; None, or the error text with the module it was raised in."""
    module = strategy.lightning_module
    devices = [strategy.root_device] if strategy.root_device.type == "cuda" else []
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    running = _RunningModules(module)
    try:
        with ExitStack() as stack:
            stack.enter_context(untouched(module))
            stack.enter_context(LogCapture(module).suppressed())
            stack.enter_context(_modes(module, step == "training_step"))
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.no_grad())
            stack.enter_context(local_collectives())
            getattr(strategy, step)(example, 0)
        return None
    except Exception as err:  # noqa: BLE001 - reported on every rank by refuse_failing_split
        where = running.stack[-1] if running.stack else ""
        return f"{type(err).__name__}: {_one_line(str(err))}" + _place(module, where)
    finally:
        running.remove()
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers and b.shape == buffers[name].shape:
                    b.copy_(buffers[name])


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _place(root: nn.Module, name: str) -> str:
    """`` (in <name>, <Class>; sharded inside it: q_proj colwise, ...)`` for the module that failed."""
    if not name:
        return " (in the LightningModule's own code, outside its submodules)"
    module = root.get_submodule(name)
    sharded = [f"{sub or '(itself)'} {_STYLES[type(m).__name__]}" for sub, m in module.named_modules()
               if type(m).__name__ in _STYLES]
    inside = f"; sharded inside it: {', '.join(sharded[:8])}{', ...' if len(sharded) > 8 else ''}" if sharded else ""
    return f" (in {name}, {type(module).__name__}{inside})"


def _failing_module(text: str) -> Optional[str]:
    found = re.search(r" \(in ([^ ,;)]+), ", text)
    return found.group(1) if found else None


def refusal(errors: list[Optional[str]], step: str, tp_size: int) -> Optional[str]:
    """The message every rank raises, from every rank's error text (None where the step ran); None if
    no rank failed. Ranks with the same error are named together, in rank order."""
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if not failed:
        return None
    def ranks(text: str) -> str:
        found = [str(r) for r, t in failed if t == text]
        return f"rank{'s' if len(found) > 1 else ''} {', '.join(found)}"

    first, *others = dict.fromkeys(text for _, text in failed)
    partial = "" if len(failed) == len(errors) else ", on some ranks only, leaving the others waiting in a collective"
    module = _failing_module(first)
    leave = (f"give strategy.tp_plan a plan that leaves {re.sub(r'[.][0-9]+(?=[.]|$)', '.*', module)} whole "
             "(no entry for it or anything inside it)" if module else "give strategy.tp_plan a plan that leaves the "
             "failing layers whole")
    return (
        f"with tensor_parallel={tp_size}, {step} fails once the model's layers are split over the TP ranks, on "
        f"{ranks(first)}: {first}\n" + "".join(f"  and on {ranks(text)}: {text}\n" for text in others) +
        f"Found at setup by running {step} forward only on the first batch; unchecked, the run would stop in its "
        f"first step{partial}. The plan's sizes fit, so the cause is likely code in that forward that uses a "
        f"sharded layer's output as if it were whole (a hard-coded width, a layer rebuilt in forward). To train "
        f"this model, {leave}, or train with data parallelism (tensor_parallel=1)."
    )

REFERENCE_LIMIT = 1_000_000_000  # parameters: above, no forward of the whole model at setup


@contextmanager
def _full_float32() -> Iterator[None]:
    """float32 matmuls in full precision (no TF32) inside: the whole model's reference often runs on the
    CPU and the split on a GPU, which must then agree to float32 rounding, not to TF32's ~1e-3."""
    precision = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn


def _values(module: nn.Module, step: str, example: Any, device: torch.device,
            random_ok: bool = False) -> Optional[list[tuple[str, torch.Tensor]]]:
    """What ``step`` returns and logs (floating values, on the CPU), forward only in eval mode; None if
    it draws random numbers there, unless ``random_ok`` (the split model's TP layers draw one seed per
    split region, ``random.py``, whether or not anything random runs)."""
    capture = LogCapture(module)
    devices = [device] if device.type == "cuda" else []
    with ExitStack() as stack:
        stack.enter_context(_full_float32())
        stack.enter_context(untouched(module))
        stack.enter_context(capture.recording())
        stack.enter_context(_modes(module, False))
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.no_grad())
        before = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        out = getattr(module, step)(example, 0)
        after = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        records = capture.records()
    drew = not torch.equal(before[0], after[0]) or any(not torch.equal(a, b) for a, b in zip(before[1], after[1]))
    if drew and not random_ok:
        return None
    named = [(f"{step}'s result", t) for t in floating_tensors(out, numbers=True)]
    named += [(f"self.log({name!r})", t) for name, value, _ in records for t in floating_tensors(value, numbers=True)]
    # scalars only (losses, logged values): what training follows; a returned tensor such as logits may be
    # left sharded on purpose (vocab-parallel loss code) and is no sign of a wrong split
    return [(name, t.detach().cpu()) for name, t in named if t.numel() == 1]


def unsplit_values(strategy: Any, trainer: Any, module: nn.Module) -> Optional[tuple[list, str, Any]]:
    """The reference for ``refuse_wrong_split``: the whole model's values on the probe's example, with the
    step's name and the example (None where it is skipped, see the module docstring). Call it on every
    rank before the model is split."""
    if trainer is None or trainer.state.fn not in _PROBED_STEPS:
        return None
    if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
        return None
    if sum(p.numel() for p in module.parameters()) > REFERENCE_LIMIT:
        return None
    batch, step = first_batch(trainer, strategy)
    if batch is None:
        return None
    device = next(module.parameters()).device
    example = small_example(batch)
    try:
        values = _values(module, step, move_data_to_device(example, device), device)
    except Exception:  # noqa: BLE001 - the whole model failing is the user's own bug, reported by the step itself
        return None
    return None if values is None else (values, step, example)


def refuse_wrong_split(strategy: Any, reference: Optional[tuple[list, str, Any]]) -> None:
    """Refuse, on every rank, a split whose step computes other values than ``unsplit_values`` found for
    the whole model. All ranks call it after ``refuse_failing_split`` (their forwards are known to finish)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, reference is not None)
    if not all(every):
        return
    want_values, step, example = reference
    found = None
    try:
        got = _values(strategy.lightning_module, step, move_data_to_device(example, strategy.root_device),
                      strategy.root_device, random_ok=True)
    except Exception as err:  # noqa: BLE001 - reported on every rank below, never left waiting in a collective
        got, found = [], f"{type(err).__name__}: {_one_line(str(err))}"
    if found is None and len(got) != len(want_values):
        found = f"{step} returns or logs {len(got)} values once split, {len(want_values)} whole"
    elif found is None:
        for (name, value), (_, want) in zip(got, want_values):
            # a split reorders sums at ~1e-6; a softmax over half an MLP's features moved a loss by 3.7e-4
            if not close(value, want, rtol=1e-4):
                found = (f"{name} is {_one_line(str(value.flatten()[:4].tolist()))} instead of "
                         f"{_one_line(str(want.flatten()[:4].tolist()))}")
                break
    dist.all_gather_object(every, found)
    if any(f is not None for f in every):
        first = next(f for f in every if f is not None)
        raise LaunchError(
            f"with tensor_parallel={strategy.options.tp}, {step} computes other values once the model's layers "
            f"are split over the TP ranks: on the first batch, in eval mode, {first}. Found at setup by comparing "
            "with the whole model on the same samples; unchecked, it would train silently wrong. Likely a forward "
            "that reduces over a sharded dimension without a collective: a norm, softmax or mean over an MLP's "
            "hidden features between its two linear layers, or a reshape with a hard-coded head count "
            "(view(B, T, 4, -1)). To train this model, give strategy.tp_plan a plan that leaves that module "
            "whole (no entry for it or anything inside it), or train with data parallelism (tensor_parallel=1)."
        )


def refuse_failing_split(strategy: Any, trainer: Any, reference: Optional[tuple[list, str, Any]] = None) -> None:
    """Probe the split model with the step the Trainer is about to run; raise the same
    ``LaunchError`` on every rank if it fails on any. All ranks must call it (one collective).
    ``reference`` (``unsplit_values``) brings the example read before the split, so the loader is not
    read again.

    Skipped where there is nothing to run or it cannot run forward only: another Trainer function
    (``predict``), no data, or ``training_step`` under manual optimisation (it steps optimizers itself).
    """
    if trainer.state.fn not in _PROBED_STEPS:
        return
    if trainer.state.fn == TrainerFn.FITTING and not strategy.lightning_module.automatic_optimization:
        return
    if reference is not None:
        _, step, example = reference
    else:
        batch, step = first_batch(trainer, strategy)
        example = None if batch is None else small_example(batch)
    error = None if example is None else _run(strategy, step, move_data_to_device(example, strategy.root_device))
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    message = refusal(errors, step, strategy.options.tp)
    if message is not None:
        raise LaunchError(message)
