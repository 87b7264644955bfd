"""Turn a full model into one rank's stage without editing its code.

The user's forward still runs from the top on every stage. Modules owned by another stage are
swapped for weightless stand-ins: a ``Placeholder`` returns zeros shaped like the real output, a
``SkipBlock`` passes the hidden state through. The block list keeps its length and names, so
``layer_types[i]`` style code and checkpoint keys stay right. During each micro-batch a
``StageRuntime`` says which blocks are active: the first one takes the hidden state received from
the previous stage, the last one (on every stage but the last) stops the forward by raising
``StageExit`` with its output, which the engine sends on. Identity checks on every block call
prove that only the hidden state flows from block to block.
"""

from __future__ import annotations

import functools
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_parallel.pipeline.errors import PipelineIncompatibleModel
from lightning_parallel.pipeline.partition import StagePlan

TENSOR, TUPLE = 0, 1  # how a block returns its hidden state: the tensor itself, or element 0


class StageExit(BaseException):
    """Raised by the last block of a non-final stage; carries that block's hidden-state output.

    A ``BaseException`` so that ``except Exception`` in user or library code cannot swallow it.
    """

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


@dataclass
class StageRuntime:
    """What the current micro-batch's forward on this rank must do; shared by all stand-ins."""

    first_block: int = -1
    last_block: int = -1
    exits: bool = False
    received: Optional[torch.Tensor] = None
    convention: int = TENSOR
    previous_out: tuple = field(default_factory=tuple)
    blocks_started: bool = False
    active: bool = False
    # id(hidden state a first block was called with) -> weak refs to it and to the received state used instead
    substituted: dict = field(default_factory=dict)

    def begin(self, blocks: range, exits: bool, received: Optional[torch.Tensor], convention: int) -> None:
        self.first_block, self.last_block, self.exits = blocks.start, blocks.stop - 1, exits
        self.received, self.convention = received, convention
        self.previous_out, self.blocks_started, self.active = (), False, True

    def end(self) -> None:
        self.received, self.previous_out, self.active = None, (), False

    def forget_substitutions(self) -> None:
        """Drop what ``recompute`` needs; the engine calls it when a step's backwards are done."""
        self.substituted.clear()

    def recompute(self, forward: Optional[Callable], args: tuple, kwargs: dict):
        """Run a block again during backward, as activation checkpointing does, with its forward's input.

        The first block of a stage was called with a stand-in hidden state and computed on the
        received one; the recomputation must use the received one too.
        """
        hidden, rest_args, rest_kwargs = _split_input(args, kwargs)
        if forward is None:  # a block of another stage passes the hidden state through, as in forward
            return hidden if self.convention == TENSOR else (hidden,)
        refs = self.substituted.get(id(hidden))
        if refs is not None and refs[0]() is hidden and refs[1]() is not None:
            hidden = refs[1]()
        if args:
            return forward(hidden, *rest_args, **rest_kwargs)
        return forward(*rest_args, **dict(rest_kwargs, hidden_states=hidden))

    def zeros(self, shape: tuple[int, ...], like: Optional[torch.Tensor]) -> torch.Tensor:
        ref = self.received if self.received is not None else like
        return torch.zeros((), dtype=ref.dtype, device=ref.device).expand(shape)


def _hidden_of(out: Any) -> tuple[torch.Tensor, int]:
    if isinstance(out, torch.Tensor):
        return out, TENSOR
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], TUPLE
    raise PipelineIncompatibleModel(
        f"a pipeline block returned {type(out).__name__}; blocks must return the hidden state as a tensor or "
        "as element 0 of a tuple"
    )


def _split_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    if args:
        return args[0], args[1:], kwargs
    if "hidden_states" in kwargs:
        rest = dict(kwargs)
        return rest.pop("hidden_states"), (), rest
    raise PipelineIncompatibleModel(
        "a pipeline block was called without a positional hidden state or a hidden_states= keyword"
    )


class BlockDispatch:
    """Decides what block ``index`` does: skip, take the received hidden state, run, or end the stage."""

    def __init__(self, runtime: StageRuntime, index: int):
        self.runtime, self.index = runtime, index

    def __call__(self, forward: Optional[Callable], *args, **kwargs):
        rt = self.runtime
        if not rt.active:
            if torch._C._current_graph_task_id() != -1:  # inside backward: activation checkpointing recomputes
                return rt.recompute(forward, args, kwargs)
            raise RuntimeError(
                f"block {self.index} was called outside a pipeline step; a partitioned model only runs through "
                "its PipelineEngine (the Trainer's training, validation, test and predict loops)"
            )
        hidden, rest_args, rest_kwargs = _split_input(args, kwargs)
        self._check_flow(hidden, rest_args, rest_kwargs)
        rt.blocks_started = True
        if self.index < rt.first_block:  # before this stage: pass the hidden state through
            out = hidden if rt.convention == TENSOR else (hidden,)
        else:
            if self.index == rt.first_block and rt.received is not None:
                rt.substituted[id(hidden)] = (weakref.ref(hidden), weakref.ref(rt.received))
                hidden = rt.received
            if forward is None or self.index > rt.last_block:
                raise RuntimeError(f"block {self.index} runs on another pipeline stage; the stage should have ended")
            call_args = (hidden,) + rest_args if args else rest_args
            if not args:
                rest_kwargs = dict(rest_kwargs, hidden_states=hidden)
            out = forward(*call_args, **rest_kwargs)
        out_hidden, rt.convention = _hidden_of(out)
        rt.previous_out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if self.index == rt.last_block and rt.exits:
            raise StageExit(out_hidden)
        return out

    def _check_flow(self, hidden, rest_args, rest_kwargs) -> None:
        previous = self.runtime.previous_out
        if self.index == 0 or not previous:
            return
        if hidden is not previous[0]:
            raise PipelineIncompatibleModel(
                f"block {self.index}: its hidden-state input is not the output of block {self.index - 1} (an "
                "operation runs between blocks); only the blocks themselves may transform the hidden state. "
                "Reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) also returns a "
                "new tensor between blocks; use use_reentrant=False, which pipeline stages support"
            )
        extra = [t for t in previous[1:] if isinstance(t, torch.Tensor)]
        if any(a is t for a in (*rest_args, *rest_kwargs.values()) for t in extra):
            raise PipelineIncompatibleModel(
                f"block {self.index} receives an output of block {self.index - 1} other than the hidden state; only "
                "one tensor (the hidden state) may flow between pipeline stages"
            )


class SkipBlock(nn.Module):
    """Stand-in for a block owned by another stage: no weights, passes the hidden state through."""

    def __init__(self, runtime: StageRuntime, index: int):
        super().__init__()
        self.dispatch = BlockDispatch(runtime, index)

    def forward(self, *args, **kwargs):
        return self.dispatch(None, *args, **kwargs)


class Placeholder(nn.Module):
    """Stand-in for an embedding, norm or head owned by another stage: returns zeros of the right shape.

    The shape follows the real module (an embedding appends its dimension, a linear layer replaces
    the last one, anything else keeps its input's shape); the dtype is that of the activation the
    stage received, so masks and rotary tables built from it get the dtype they would have had.
    """

    def __init__(self, runtime: StageRuntime, original: nn.Module, name: str, before_blocks: bool):
        super().__init__()
        self.runtime, self.name, self.before_blocks = runtime, name, before_blocks
        if isinstance(original, nn.Embedding):
            self.kind, self.dim = "append", original.embedding_dim
        elif isinstance(original, nn.Linear):
            self.kind, self.dim = "replace", original.out_features
        else:
            self.kind, self.dim = "same", 0

    def forward(self, *args, **kwargs):
        check_order(self.runtime, self.name, self.before_blocks)
        x = args[0] if args else next(iter(kwargs.values()))
        if self.kind == "append":
            shape = (*x.shape, self.dim)
        elif self.kind == "replace":
            shape = (*x.shape[:-1], self.dim)
        else:
            shape = tuple(x.shape) if x.is_floating_point() or self.runtime.received is None else self.runtime.received.shape
        return self.runtime.zeros(shape, x if x.is_floating_point() else None)

    def extra_repr(self) -> str:
        return f"{self.name}, owned by another pipeline stage"


def check_order(runtime: StageRuntime, name: str, before_blocks: bool) -> None:
    """A module registered before the blocks must run before them, and one registered after, after."""
    if runtime.active and runtime.blocks_started == before_blocks:
        where = "after" if before_blocks else "before"
        raise PipelineIncompatibleModel(
            f"{name} is registered {'before' if before_blocks else 'after'} the block list but runs {where} the "
            "blocks; pipeline stages assume modules run in registration order around the blocks. Register it "
            "on the other side of the block list"
        )


def _dispatched_forward(block: nn.Module, *args, **kwargs):
    """Forward of an owned block: its class's own forward, run when the runtime says so."""
    return block._pipeline_dispatch(functools.partial(type(block).forward, block), *args, **kwargs)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def apply_stage_plan(module: nn.Module, plan: StagePlan, rank: int, runtime: StageRuntime) -> None:
    """Keep on ``module`` only what ``rank`` owns; route every block call through the runtime."""
    my_stages = set(plan.stages_of_rank(rank))
    for name in plan.pre + plan.post:
        before = name in plan.pre
        owner = 0 if before else plan.num_stages - 1
        if owner in my_stages:
            module.get_submodule(name).register_forward_pre_hook(
                lambda _m, _a, name=name, before=before: check_order(runtime, name, before)
            )
        else:
            _set_submodule(module, name, Placeholder(runtime, module.get_submodule(name), name, before))
    blocks = module.get_submodule(plan.blocks_path)
    for i in range(len(blocks)):
        if plan.block_owner(i) in my_stages:
            # an instance attribute, so names, hooks and the block's class stay as they were
            blocks[i]._pipeline_dispatch = BlockDispatch(runtime, i)
            blocks[i].forward = types.MethodType(_dispatched_forward, blocks[i])
        else:
            blocks[i] = SkipBlock(runtime, i)
