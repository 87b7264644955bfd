"""The split checked in the run's first step, which is a real one: the user's code runs no extra time.

The plan checks (``resolve.py``, ``shapes.py``) see module types and sizes, not the code of a model's
``forward``. Some forwards only break once their layers hold shards or their sequence is split: Doge's
own Hugging Face plan makes ``dt_proj`` rowwise while its output is then used per local head; a
hand-written module reshapes with a hard-coded full width; an attention takes a mask context
parallelism cannot split. Others run and compute something else (a norm over an MLP's split hidden
features). Both are found on the first batch, without a second call of the user's step: a user's
``training_step`` may print, count, update metrics, log to an outside service or step optimizers
itself, so it runs exactly as often as under Lightning's ``ddp``.

``FirstStepCheck`` wraps the first step the Trainer runs on the split model (the sanity check's
``validation_step`` in ``fit``, else the first ``training_step``; ``validate``/``test``: their first
step):

- **It fails.** The exception is raised again as a ``LaunchError`` naming the innermost module that
  was running and the sharded layers inside it, and what to change. No parameter has changed yet: the
  optimizer has not stepped. A rank that fails alone leaves its peers in a collective; its process
  ends, and the launcher (Lightning's, torchrun, ``srun --kill-on-bad-exit``) ends theirs, or their
  collective fails on the closed connection and is raised as it is (the failing rank's error says why).
- **It runs.** Under context parallelism, a block in which no attention went round the ring (attention
  written out by hand) is refused (``ContextParallel.counting``). While it ran, forward pre-hooks recorded what one unit of each kind received (a block,
  the embedding, the head: ``split_units.py``); right after the step's forward, each is run split and
  whole in float64 on those inputs, outputs and gradients compared (``verify_split.SplitChecker``).
  A split that computes other values is refused on every rank alike, before the first optimizer step.

Pipeline parallelism and ZeRO-2/3 with tensor parallelism check at setup instead (the stages are cut
on a traced run, and ZeRO's sharded parameters have no tensor-parallel layout left to compare with:
``compose.py``).
"""

from __future__ import annotations

import re
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.errors import LaunchError, LightningParallelError

from .model_line import model_lines
from .split_run import capture_inputs
from .verify_split import SplitChecker, Verification, refuse_differences

_STYLES = {"ColumnParallelLinear": "colwise", "RowParallelLinear": "rowwise", "VocabParallelEmbedding": "vocab"}


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


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def place(root: nn.Module, name: str) -> str:
    """`` (in <name>, <Class>; sharded inside it: q_proj colwise, ...)`` for the module that failed."""
    if not name:
        return " (in the LightningModule's own code, outside its submodules)"
    module = root.get_submodule(name)
    sharded = [f"{sub or '(itself)'} {_STYLES[type(m).__name__]}" for sub, m in module.named_modules()
               if type(m).__name__ in _STYLES]
    inside = f"; sharded inside it: {', '.join(sharded[:8])}{', ...' if len(sharded) > 8 else ''}" if sharded else ""
    return f" (in {name}, {type(module).__name__}{inside})"


def failure(step: str, error: str, where: Optional[str], tp: int, cp: int, rank: int,
            lines: tuple[str, ...] = ()) -> str:
    """The refusal of a split whose first ``step`` raised ``error`` on ``rank`` in module ``where``, at
    ``lines`` of model code (``model_line.py``; outermost first)."""
    split = " and ".join(part for part in (
        f"the model's layers are split over tensor_parallel={tp} ranks" if tp > 1 else "",
        f"each sequence is split over context_parallel={cp} ranks" if cp > 1 else "") if part)
    if tp > 1:
        leave = (f"give strategy.tp_plan a plan that leaves {re.sub(r'[.][0-9]+(?=[.]|$)', '.*', where)} whole "
                 "(no entry for it or anything inside it)" if where else
                 "give strategy.tp_plan a plan that leaves the failing layers whole")
        code = (f"the model code that fails: {' -> '.join(lines)}, which reads a split width as if it were whole"
                if lines else "code in that forward that uses a sharded layer's output as if it were whole")
        fix = (f"The plan's sizes fit, so the cause is likely {code} (a hard-coded width, a layer built over every "
               f"head's features, a layer rebuilt in forward). To train this model, "
               f"{leave}, or train with data parallelism (tensor_parallel=1).")
    else:
        fix = "To train this model, train without context parallelism (context_parallel=1)."
    return (f"{step} fails once {split}, on rank {rank}: {error}\nFound in the first step, before any parameter "
            f"changed. {fix}")


def _peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because a peer process ended (gloo, NCCL)."""
    text = str(err)
    return isinstance(err, dist.DistError) or "closed by peer" in text or "Connection reset" in text


class FirstStepCheck:
    """Run once, around the first step on the split model (see the module docstring); all ranks run it."""

    def __init__(self, module: nn.Module, checker: Optional[SplitChecker], tp: int, context: Optional[Any],
                 device: torch.device) -> None:
        self.module, self.checker, self.tp, self.context, self.device = module, checker, tp, context, device
        self.cp = context.ring.size if context is not None else 1
        self.done = False
        self.verification: Optional[Verification] = None

    def run(self, step: str, run_step: Callable[[], Any]) -> Any:
        """``run_step()``'s result; the first time, checked as the module docstring says."""
        if self.done:
            return run_step()
        self.done = True
        held = self.checker.held(self.module) if self.checker is not None else []
        names = [n for unit in held for n in unit.part_names()]
        result: list = []
        running = _RunningModules(self.module)
        try:
            with self.context.counting() if self.context is not None else nullcontext():
                captured = capture_inputs(self.module, names, lambda: result.append(run_step()))
        except LightningParallelError:
            raise
        except Exception as err:
            if _peer_lost(err):  # another rank failed first: its own error says why
                raise
            where = running.stack[-1] if running.stack else ""
            text = f"{type(err).__name__}: {_one_line(str(err))}" + place(self.module, where)
            lines = tuple(model_lines(err))
            raise LaunchError(failure(step, text, where, self.tp, self.cp, dist.get_rank(), lines)) from err
        finally:
            running.remove()
        if self.checker is not None:
            with ExitStack() as stack:  # an evaluation step runs under inference mode: the check needs autograd
                stack.enter_context(torch.inference_mode(False))
                stack.enter_context(torch.enable_grad())
                self.verification, found = self.checker.compare_captured(self.module, held, captured, self.device)
            refuse_differences(found, self.tp)
        return result[0]
