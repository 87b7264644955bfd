"""Turn a full model into one rank's stage without editing its code.

The user's forward still runs from the top on every stage. Modules owned by another stage are
swapped for weightless stand-ins: a ``Placeholder`` returns zeros shaped like the real output, a
``SkipBlock`` passes the hidden state through and carries the plain attributes of the block it
replaces (``attention_type``, ``layer_idx``), which outer forwards read. The block list keeps its
length and names, so ``layer_types[i]`` style code and checkpoint keys stay right. During each
micro-batch a ``StageRuntime`` says which blocks are active: the first one takes the hidden state
received from the previous stage; on every stage but the last, the call of the first block *after*
the stage stops the forward by raising ``StageExit`` with that call's hidden-state input, which the
engine sends on. Ending at the next block's input rather than at the last block's output carries
across the boundary whatever the caller computes between blocks (``x = 0.9 * block(x)``): the
sending stage computes it once, and the receiving stage's first block gets exactly that tensor.

A caller that also keeps the block's input (``h = h + block(h)``) uses its own copy of ``h`` after
the first block, not the block's argument. So the stand-in just before a stage returns the received
state: the caller's update then turns its stale ``h``, zeros from the placeholders, into
``0 + received``, the exact value. ``PipelineEngine.partition`` checks at setup that the caller's
copy indeed equals the received state wherever the caller reuses a block's input
(``StageRuntime.probing``); ``order.trace_run_order`` checks that nothing else crosses.

In a step that generates, ``StageRuntime.relay`` is set and every block call goes to it instead: the
whole forward runs on every rank, each block on its owner (``relay``); the stand-ins before and after
the blocks return None there, replaced by the relay's hooks with what their owner computed.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_parallel.compat import in_backward, tree_flatten, tree_map
from lightning_parallel.pipeline.errors import REPEATED_FORWARD, PipelineIncompatibleModel, without_gradients
from lightning_parallel.pipeline.partition import StagePlan

TENSOR = 0  # how a block returns its hidden state: the tensor itself (0), or element 0 of a tuple of that length


def wrap(hidden: torch.Tensor, convention: int) -> Any:
    """A stand-in block's output in the real blocks' form: the tensor, or a tuple of the blocks' length
    (``hidden, state, attentions = block(...)`` still unpacks) with None after the hidden state."""
    return hidden if convention == TENSOR else (hidden, *([None] * (convention - 1)))


class StageExit(BaseException):
    """Raised by the first block after a non-final stage; carries that block's hidden-state input.

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
    # set by ``probe``: whether the caller's own hidden state at the first block equalled the received one
    probing: bool = False
    caller_matches: Optional[bool] = None
    training: bool = False
    device: torch.device = torch.device("cpu")  # where the stage computes (meta while probing a meta-device model)
    # set during a step that generates: every block call goes to it (``relay.Relay``), whole forwards run
    relay: Any = None
    stage: int = 0
    received_taken: bool = False  # the first block took the received state in this forward

    def begin(self, blocks: range, exits: bool, received: Optional[torch.Tensor], convention: int,
              training: bool = False) -> None:
        self.training = training
        self.first_block, self.last_block, self.exits = blocks.start, blocks.stop - 1, exits
        self.received, self.convention = received, convention
        self.previous_out, self.blocks_started, self.active = (), False, True
        self.received_taken = False

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
            return wrap(hidden, self.convention)
        refs = self.substituted.get(id(hidden))
        if refs is not None and refs[0]() is hidden and refs[1]() is not None:
            hidden = refs[1]()
        if args:
            return forward(hidden, *rest_args, **rest_kwargs)
        return forward(*rest_args, **dict(rest_kwargs, hidden_states=hidden))

    def zeros(self, shape: tuple[int, ...], like: Optional[torch.Tensor]) -> torch.Tensor:
        """Zeros of ``shape`` on the stage's device: floating ones in the received activation's dtype."""
        ref = self.received if self.received is not None else like
        dtype = like.dtype if like is not None and not like.is_floating_point() else ref.dtype
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def stand_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A weightless stand-in for a parameter or buffer of a module another stage owns: zeros of its
        shape and dtype on the stage's device, one expanded element (no memory for a whole table)."""
        return torch.zeros((), dtype=tensor.dtype, device=self.device).expand(tensor.shape)


def _hidden_of(out: Any) -> tuple[torch.Tensor, int]:
    if isinstance(out, torch.Tensor):
        return out, TENSOR
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], len(out)
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

    def __init__(self, runtime: StageRuntime, index: int, cache_index: Optional[int] = None):
        self.runtime, self.index = runtime, index
        self.cache_index = index if cache_index is None else cache_index  # the block's layer in a KV cache

    def __call__(self, forward: Optional[Callable], *args, **kwargs):
        rt = self.runtime
        if rt.relay is not None:
            return rt.relay.block(self.index, forward, self.cache_index, args, kwargs)
        if not rt.active:
            if in_backward():  # inside backward: activation checkpointing recomputes
                return rt.recompute(forward, args, kwargs)
            raise RuntimeError(
                f"block {self.index} was called outside a pipeline step; a partitioned model only runs through "
                "its PipelineEngine (the Trainer's training, validation, test and predict loops)"
            )
        hidden, rest_args, rest_kwargs = _split_input(args, kwargs)
        self._check_flow(rest_args, rest_kwargs)
        rt.blocks_started = True
        if rt.exits and self.index == rt.last_block + 1:
            raise StageExit(hidden)
        if self.index < rt.first_block:  # before this stage: pass the hidden state through
            if self.index == rt.first_block - 1 and rt.received is not None:
                hidden = rt.received  # the caller's update after this block then starts from the received state
            out = wrap(hidden, rt.convention)
        else:
            if self.index == rt.first_block and rt.received is not None:
                if rt.received_taken and hidden.shape != rt.received.shape:
                    # a second forward of the step, on another input (a decoding loop's longer sequence or new
                    # token), would start from the first one's received state
                    raise PipelineIncompatibleModel(REPEATED_FORWARD.format(stage=rt.stage))
                rt.received_taken = True
                if rt.probing and not hidden.is_meta:  # a meta-device model has no values to compare
                    rt.caller_matches = hidden is rt.received or torch.equal(hidden, rt.received)
                rt.substituted[id(hidden)] = (weakref.ref(hidden), weakref.ref(rt.received))
                hidden = rt.received
            if forward is None or self.index > rt.last_block:
                raise RuntimeError(f"block {self.index} runs on another pipeline stage; the stage should have ended")
            if rt.training and not torch.is_grad_enabled():
                raise PipelineIncompatibleModel(without_gradients(self.index))
            call_args = (hidden,) + rest_args if args else rest_args
            if not args:
                rest_kwargs = dict(rest_kwargs, hidden_states=hidden)
            out = forward(*call_args, **rest_kwargs)
        _, rt.convention = _hidden_of(out)
        rt.previous_out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return out

    def _check_flow(self, rest_args, rest_kwargs) -> None:
        previous = self.runtime.previous_out
        if self.index == 0 or not previous:
            return
        extra = [t for t in previous[1:] if isinstance(t, torch.Tensor)]
        if any(a is t for a in (*rest_args, *rest_kwargs.values()) for t in extra):
            raise PipelineIncompatibleModel(
                f"block {self.index} receives an output of block {self.index - 1} other than the hidden state; only "
                "one tensor (the hidden state) may flow between pipeline stages"
            )


def _copy_plain_attributes(original: nn.Module, shell: nn.Module) -> None:
    """Give ``shell`` the public non-module attributes of ``original`` and attribute-only copies of its children.

    Parameters and buffers are left behind (that is the point of a stand-in), replaced by plain
    meta-device attributes of their shape and dtype; configuration values such as
    ``attention_type`` or ``layer_idx`` that the caller reads from each block stay readable.
    """
    for name, value in vars(original).items():
        if not name.startswith("_") and name != "training" and not hasattr(shell, name):
            setattr(shell, name, value)
    for name, tensor in [*original.named_parameters(recurse=False), *original.named_buffers(recurse=False)]:
        if tensor is not None and not hasattr(shell, name):
            object.__setattr__(shell, name, torch.empty_like(tensor, device="meta"))
    for name, child in original.named_children():
        copy = nn.Module()
        _copy_plain_attributes(child, copy)
        shell.add_module(name, copy)


def _layer_index(block: nn.Module) -> Optional[int]:
    """The index under which ``block`` keeps its keys and values in a Hugging Face cache (the
    ``layer_idx`` of the block or of its attention), or None."""
    return next((m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)


class SkipBlock(nn.Module):
    """Stand-in for a block owned by another stage: no weights, passes the hidden state through."""

    def __init__(self, runtime: StageRuntime, index: int, original: nn.Module):
        super().__init__()
        self._dispatch = BlockDispatch(runtime, index, _layer_index(original))
        _copy_plain_attributes(original, self)

    def forward(self, *args, **kwargs):
        return self._dispatch(None, *args, **kwargs)


def _meta_copy(module: nn.Module) -> Optional[nn.Module]:
    """``module`` with its parameters and buffers on the meta device (no memory); None for modules of
    ``tensor_parallel``, whose forward would run collectives."""
    if any(type(m).__module__.startswith("lightning_parallel.") for m in module.modules()):
        return None
    memo: dict = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device, torch.Size)
_MISSING = object()


def _plain(value: Any) -> bool:
    """A tensor (its shape and dtype are what a meta run sees) or an immutable constant."""
    return value is None or isinstance(value, (torch.Tensor, *_CONSTANTS))


def _signature(tree: tuple[tuple, dict]) -> Optional[tuple]:
    """What a meta run can see of ``tree``: its structure, each tensor's shape and dtype, every other
    value; None where a value could change behind an equal key (any object but a constant), so the run
    is not cached."""
    args, kwargs = tree
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the usual call, without pytree's cost
        return tuple((a.shape, a.dtype) for a in args)
    leaves, spec = tree_flatten(tree)
    if not all(_plain(v) for v in leaves):
        return None
    return spec, tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (type(v), v) for v in leaves)


class Placeholder(nn.Module):
    """Stand-in for an embedding, norm or head owned by another stage: returns zeros of the right shape.

    The shape is that of the real module's output, found by running a copy of it on the meta device
    (no memory, no arithmetic); where that fails, it follows the module's type (an embedding appends
    its dimension, a linear layer replaces the last one, anything else keeps its input's shape). The
    dtype is that of the activation the stage received, so masks and rotary tables built from it get
    the dtype they would have had. The zeros are real (not an expanded scalar), so code that writes
    into them in place still runs. Attributes of the module stay readable through the meta copy.

    On meta tensors the output can only depend on the arguments' shapes, dtypes and plain values, so
    the meta run's result is kept per such signature (``_signature``) and later calls with the same
    one skip it: the meta run costs a stage's forward more than the stage's own Python does.
    """

    def __init__(self, runtime: StageRuntime, original: nn.Module, name: str, before_blocks: Optional[bool]):
        super().__init__()
        self.runtime, self.name, self.before_blocks = runtime, name, before_blocks
        if isinstance(original, nn.Embedding):
            self.kind, self.dim = "append", original.embedding_dim
        elif isinstance(original, nn.Linear):
            self.kind, self.dim = "replace", original.out_features
        else:
            self.kind, self.dim = "same", 0
        object.__setattr__(self, "_meta", _meta_copy(original))  # unregistered: not a submodule, no state
        if self._meta is None:
            _copy_plain_attributes(original, self)
        object.__setattr__(self, "_outputs", {})  # the forward's meta output per argument signature

    def _zeros(self, out: Any) -> Any:
        if type(out) is torch.Tensor:
            return self.runtime.zeros(out.shape, out)
        return tree_map(lambda t: self.runtime.zeros(t.shape, t) if isinstance(t, torch.Tensor) else t, out)

    def _on_meta(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """``fn`` of the meta copy on meta versions of the arguments, its tensors then turned into zeros."""
        with torch.no_grad():
            out = fn(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        return self._zeros(out)

    def __getattr__(self, name: str) -> Any:
        """What the caller reads from the real module comes from the meta copy: plain values; for a
        tensor (``ngram_embeddings.weight`` read and indexed by ProphetNet's decoder) zeros of its shape
        and dtype on the stage's device, so arithmetic with the stage's tensors runs; a method it
        calls (``embed_positions._forward(ids)``) runs there and returns zeros."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_meta")
            if meta is None:
                raise
            value = getattr(meta, name)
            if inspect.ismethod(value):
                return lambda *args, **kwargs: self._on_meta(value, args, kwargs)
            return self.runtime.stand_in(value) if isinstance(value, torch.Tensor) else value

    def forward(self, *args, **kwargs):
        if self.runtime.relay is not None:  # the owner's output arrives through the relay's hook on this module
            return None
        if self.before_blocks is not None:
            check_order(self.runtime, self.name, self.before_blocks)
        if self._meta is not None:
            key = _signature((args, kwargs))
            out = self._outputs.get(key, _MISSING) if key is not None else _MISSING
            if out is _MISSING:
                try:
                    with torch.no_grad():
                        out = self._meta(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
                except Exception:  # noqa: BLE001 - data-dependent code cannot run on meta; fall back to the type
                    object.__setattr__(self, "_meta", None)
                else:
                    if key is not None and all(_plain(v) for v in tree_flatten(out)[0]):
                        self._outputs[key] = out
            if out is not _MISSING:
                return self._zeros(out)
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


@contextmanager
def called_directly(module: nn.Module) -> Iterator[None]:
    """Inside, the owned blocks in ``module`` (or ``module`` itself) run their class's forward when called,
    as outside a pipeline: for setup checks that compare a block with a whole copy of it."""
    dispatched = [m for m in module.modules() if "_pipeline_dispatch" in vars(m) and "forward" in vars(m)]
    forwards = [vars(m).pop("forward") for m in dispatched]
    try:
        yield
    finally:
        for m, forward in zip(dispatched, forwards):
            m.forward = forward


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
            if plan.traced:  # the order was seen in a forward at setup
                continue
            module.get_submodule(name).register_forward_pre_hook(
                lambda _m, _a, name=name, before=before: check_order(runtime, name, before)
            )
        else:
            _set_submodule(module, name, Placeholder(runtime, module.get_submodule(name), name,
                                                     None if plan.traced else before))
    blocks = module.get_submodule(plan.blocks_path)
    for i in range(len(blocks)):
        if plan.block_owner(i) in my_stages:
            # an instance attribute, so names, hooks and the block's class stay as they were
            blocks[i]._pipeline_dispatch = BlockDispatch(runtime, i)
            blocks[i].forward = types.MethodType(_dispatched_forward, blocks[i])
        else:
            blocks[i] = SkipBlock(runtime, i, blocks[i])
