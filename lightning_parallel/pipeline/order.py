"""Learn from one forward of the whole model the order its modules run in, and check what crosses stages.

Stages are cut at the order modules *run* in, not the order they are registered in: LitGPT's
``GPT`` registers ``lm_head`` before its blocks, OPT registers ``final_layer_norm`` and
``project_out`` before its layers, yet all of them run after the last block. ``trace_run_order``
runs the user's own step once on one micro-batch at setup, on every rank and before the first
collective of training, with forward hooks on every module outside the block list. A
parameter-holding module that runs before the first block goes to the first stage, one that runs
after the last block to the last stage, wherever it is registered. A module before the blocks
whose output the blocks take as a side input (a position-bias table, the embedding passed to every
block as ``x0``) is kept on every stage instead: each stage computes it, and its gradient is summed
over the stages like a tied weight's.

The same forward decides, on every rank alike, whether the model can be split at all. A stage ends
where the *next* block is called and hands over that block's hidden-state input, so whatever the
caller computes between two blocks (``h = h + block(h)``, a scale) is computed once, on the
sending stage, and carried across (``stage_modules``). Every other value a later stage recomputes
from the batch; what it cannot recompute is what a stand-in replaced (the outputs of earlier
stages' blocks and of the first stage's modules), so the autograd graph of the trace is searched
for such values reaching a place the hidden state does not carry them:

* the hidden-state input of block ``j`` may depend on block ``j - 1``, its input and the batch,
  nothing earlier (U-Net style skips are refused);
* the other arguments of a block may not depend on any block, nor on a first-stage module
  (cross-block state such as T5's position bias returned by block 0);
* the step's result may depend on the last block and its input, not on earlier ones
  (``output_hidden_states`` mixed into the loss);
* a parameter-holding module outside the blocks may not run between or inside them, nor both before
  and after them; the blocks run once each, in order; none runs with gradients disabled (reentrant
  activation checkpointing, or ``torch.no_grad()`` inside the step itself).

Parameters are made to require gradients for the trace, so frozen parts (LoRA) leave a graph too.
Dependencies outside autograd (integer tensors, Python numbers, attributes set during forward) are
not seen here; ``PipelineEngine.partition`` catches them by running each stage on the traced values.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_parallel.pipeline.errors import PipelineIncompatibleModel, without_gradients

BEFORE, BETWEEN, AFTER = "before", "between", "after"


@dataclass(frozen=True)
class RunOrder:
    """Parameter-holding modules outside the block list that run before / after the blocks.

    What the traced forward computed, for ``PipelineEngine.partition`` to check each stage against:
    ``inputs``, the hidden-state input of every block (detached copies); ``results``, the floating
    tensors the step returned; ``deterministic``, whether it drew no random numbers (else values of a
    rerun differ anyway). ``reused``: blocks whose input the caller uses again after the block
    (``h = h + block(h)``). ``arity``: 0 if blocks return the hidden state, else the length of the
    tuple whose element 0 it is. ``replicated``: modules before the blocks whose output the blocks take
    as a side input (a position bias, ``x0``); they stay on every stage, their gradients summed.
    """

    pre: tuple[str, ...]
    post: tuple[str, ...]
    inputs: tuple = ()
    results: tuple = ()
    deterministic: bool = False
    reused: frozenset = frozenset()
    arity: int = 0
    replicated: tuple[str, ...] = ()


def _hidden_input(args: tuple, kwargs: dict) -> tuple[Any, list]:
    if args:
        return args[0], [*args[1:], *kwargs.values()]
    rest = dict(kwargs)
    return rest.pop("hidden_states", None), list(rest.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _first_tensor(out: Any) -> Any:
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    if isinstance(out, dict) and out:
        return next(iter(out.values()))
    return out


def _node(t: Any):
    return t.grad_fn if isinstance(t, torch.Tensor) else None


def _reach(roots: list, stops: set[int]) -> dict[int, Any]:
    """Autograd nodes reachable from ``roots`` without passing through a node in ``stops`` (by id)."""
    seen: dict[int, Any] = {}
    todo = [r for r in roots if r is not None and id(r) not in stops]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        todo.extend(n for n, _ in node.next_functions if n is not None and id(n) not in stops)
    return seen


class _Recorder:
    """Forward hooks: when each outer module runs relative to the blocks; each block's inputs and output."""

    def __init__(self, n_blocks: int):
        self.n = n_blocks
        self.entered: list[int] = []
        self.finished = 0
        self.phases: dict[str, set[str]] = {}
        self.pre_outputs: dict[str, list[torch.Tensor]] = {}  # module name -> outputs, before the blocks
        self.inputs: dict[int, Any] = {}
        self.extras: dict[int, list] = {}
        self.outputs: dict[int, Any] = {}
        self.other_outputs: dict[int, list[torch.Tensor]] = {}
        self.results: list[torch.Tensor] = []
        self.copies: dict[int, torch.Tensor] = {}
        self.arity = 0

    def phase(self) -> str:
        if not self.entered:
            return BEFORE
        return AFTER if self.finished == self.n and len(self.entered) == self.n else BETWEEN

    def outer_pre(self, name: str):
        def hook(_module, _args):
            self.phases.setdefault(name, set()).add(self.phase())
        return hook

    def outer_post(self, name: str, holds_params: bool):
        def hook(_module, _args, out):
            if holds_params and self.phase() == BEFORE:
                self.pre_outputs.setdefault(name, []).extend(_tensors(out))
        return hook

    def block_pre(self, index: int):
        def hook(_module, args, kwargs):
            if not torch.is_grad_enabled():
                raise PipelineIncompatibleModel(without_gradients(index))
            self.entered.append(index)
            if index not in self.inputs:
                self.inputs[index], self.extras[index] = _hidden_input(args, kwargs)
                if isinstance(self.inputs[index], torch.Tensor):  # a copy: the caller may update it in place
                    self.copies[index] = self.inputs[index].detach().clone()
        return hook

    def block_post(self, index: int):
        def hook(_module, _args, _kwargs, out):
            self.finished += 1
            if index not in self.outputs:
                self.arity = len(out) if isinstance(out, (tuple, list)) else 0
                self.outputs[index] = _first_tensor(out)
                self.other_outputs[index] = [t for t in _tensors(out) if t is not self.outputs[index]]
        return hook


def trace_run_order(module: nn.Module, blocks_path: str, step: Callable[[], Any]) -> RunOrder:
    """Run ``step`` (the user's step on one micro-batch) once and return where the outer modules run.

    Raises ``PipelineIncompatibleModel`` with the rule the model breaks. Leaves no trace: random
    number generators, buffers, ``requires_grad`` flags and hooks are restored.
    """
    blocks = module.get_submodule(blocks_path)
    recorder = _Recorder(len(blocks))
    def outside(name: str) -> bool:  # neither the root, the block list, inside it, nor one of its ancestors
        within = name == blocks_path or name.startswith(blocks_path + ".")
        return bool(name) and not within and not blocks_path.startswith(name + ".")

    outer = [(name, m) for name, m in module.named_modules() if outside(name)]
    handles = []
    for name, m in outer:
        handles.append(m.register_forward_pre_hook(recorder.outer_pre(name)))
        holds_params = any(True for _ in m.parameters(recurse=False))
        handles.append(m.register_forward_hook(recorder.outer_post(name, holds_params)))
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(recorder.block_pre(i), with_kwargs=True))
        handles.append(block.register_forward_hook(recorder.block_post(i), with_kwargs=True))
    try:
        with traced_conditions(module):
            states = _rng_states(module)
            result = step()
            deterministic = all(torch.equal(a, b) for a, b in zip(states, _rng_states(module)))
    finally:
        for h in handles:
            h.remove()
    _check_block_calls(recorder, blocks_path)
    recorder.results = _tensors(result)
    pre, post = _assign(module, blocks_path, recorder)
    side = _reach([_node(t) for j in range(recorder.n) for t in _tensors(recorder.extras[j])], set())
    replicated = tuple(name for name in pre if any(id(_node(t)) in side for t in _outputs_of(recorder, name)))
    pre = tuple(name for name in pre if name not in replicated)
    _check_dataflow(recorder, recorder.results, blocks_path, [t for name in pre for t in _outputs_of(recorder, name)])
    inputs = tuple(recorder.copies.get(j) for j in range(recorder.n))
    results = tuple(t.detach() for t in recorder.results if t.is_floating_point())
    return RunOrder(pre, post, inputs, results, deterministic, _reused(recorder), recorder.arity, replicated)


def _outputs_of(rec: _Recorder, name: str) -> list[torch.Tensor]:
    """What ``name`` and its submodules returned before the blocks."""
    return [t for n, ts in rec.pre_outputs.items() if n == name or n.startswith(name + ".") for t in ts]


def _cuda_devices(module: nn.Module) -> list[int]:
    """The CUDA devices ``module``'s parameters are on: those whose random streams its forward draws from."""
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


def _rng_states(module: nn.Module) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in _cuda_devices(module))]


def _reused(rec: _Recorder) -> frozenset:
    """Blocks whose input the caller reads again after them: the next block's input (for the last
    block, any later value) reaches the block's input without passing through the block's output."""
    reused = set()
    for j in range(1, rec.n):
        x, out, nxt = _node(rec.inputs[j]), _node(rec.outputs[j]), _node(rec.inputs[j + 1]) if j + 1 < rec.n else None
        later = [nxt] if nxt is not None else [_node(t) for t in rec.results]
        if x is not None and id(x) in _reach(later, {id(out)} if out is not None else set()):
            reused.add(j)
    return frozenset(reused)


@contextmanager
def traced_conditions(module: nn.Module) -> Iterator[None]:
    """How the trace (and the stage probes compared with it) run: gradients on, every floating
    parameter requiring them; random number generators and buffers (batch-norm statistics) restored
    on exit."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    frozen = [p for p in module.parameters() if not p.requires_grad and p.is_floating_point()]
    try:
        with torch.random.fork_rng(devices=_cuda_devices(module)), torch.enable_grad():
            for p in frozen:
                p.requires_grad_(True)
            yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers and b.shape == buffers[name].shape:
                    b.copy_(buffers[name])


def _check_block_calls(rec: _Recorder, path: str) -> None:
    if rec.entered != list(range(rec.n)):
        shown = rec.entered if len(rec.entered) <= 12 else rec.entered[:12] + ["..."]
        whole = list(range(rec.n))
        repeated = len(rec.entered) > rec.n and rec.entered == whole * (len(rec.entered) // rec.n)
        raise PipelineIncompatibleModel(
            f"the blocks of {path} ran in the order {shown} in one forward; pipeline stages need each of its {rec.n} "
            f"blocks to run exactly once, in order (0..{rec.n - 1}). Set pipeline_blocks to a block list that does, "
            "or train without pipelining (pipeline_parallel=1)"
            + ("; the step runs the whole model more than once: a decoding loop in an evaluation step runs through "
               "the stages when it is a method named generate (of the module or the model) that the step calls"
               if repeated else "")
        )


def _check_dataflow(rec: _Recorder, results: list[torch.Tensor], path: str, pre_outputs: list[torch.Tensor]) -> None:
    n = rec.n
    inputs = [_node(rec.inputs[j]) for j in range(n)]
    outputs = [_node(rec.outputs[j]) for j in range(n)]
    replaced = {id(node): "the output of a module that runs before the blocks" for node in map(_node, pre_outputs)
                if node is not None}

    def forbidden(before: int) -> dict[int, str]:
        """Values a stage that starts at block ``before`` gets from stand-ins, by node id."""
        names = dict(replaced)
        for k in range(before):
            pairs = [(outputs[k], f"the output of block {k}")]
            if k > 0:  # block 0's input is made before the blocks, where `replaced` marks what stand-ins replace
                pairs.append((inputs[k], f"the input of block {k}"))
            for node, what in pairs:
                if node is not None:
                    names.setdefault(id(node), what)
        return names

    def check(roots: list, stop: Any, before: int, what: str, rule: str) -> None:
        bad = forbidden(before)
        stops = {id(stop)} if stop is not None else set()
        hit = next((bad[k] for k in _reach(roots, stops) if k in bad), None)
        if hit is not None:
            raise PipelineIncompatibleModel(
                f"{what} depends on {hit}; {rule}. Only the hidden state crosses a pipeline stage boundary, and "
                "a later stage recomputes everything else from the batch. Train this model with pipeline_parallel=1, "
                f"or set pipeline_blocks to a block list ({path} now) between which only the hidden state flows"
            )

    for j in range(1, n):
        if any(a is t for a in _tensors(rec.extras[j]) for t in rec.other_outputs[j - 1]):
            raise PipelineIncompatibleModel(
                f"block {j} receives an output of block {j - 1} other than the hidden state; only one tensor (the "
                f"hidden state) may flow between pipeline stages. Train this model with pipeline_parallel=1"
            )
    for j in range(n):
        extra = [_node(t) for t in _tensors(rec.extras[j])]
        check(extra, None, n, f"an argument of block {j} other than the hidden state",
              "arguments other than the hidden state may depend only on the batch (cross-block state such as a "
              "position bias returned by one block and passed to the next cannot be split)")
    for j in range(1, n):
        check([inputs[j]], inputs[j - 1], j - 1, f"the hidden-state input of block {j}",
              f"it may depend only on block {j - 1}, its input and the batch")
    check([_node(t) for t in results], inputs[n - 1], n - 1, "the step's result",
          f"after the blocks, the model may use only the last block ({n - 1}), its input and the batch "
          "(intermediate hidden states, as with output_hidden_states, cannot reach the last stage)")


def outside_blocks(module: nn.Module, blocks_path: str) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(name, module, registered after the blocks)`` for each largest parameter-holding submodule
    outside the block list, in registration order."""
    seen_blocks = False

    def visit(mod: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, bool]]:
        nonlocal seen_blocks
        for name, child in mod.named_children():
            full = prefix + name
            if full == blocks_path:
                seen_blocks = True
            elif blocks_path.startswith(full + "."):
                yield from visit(child, full + ".")
            elif any(True for _ in child.parameters()):
                yield full, child, seen_blocks

    yield from visit(module, "")


def _assign(module: nn.Module, path: str, rec: _Recorder) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each maximal parameter-holding module outside the blocks goes before or after them, by when it ran."""
    pre: list[str] = []
    post: list[str] = []

    def phases_of(name: str) -> set[str]:
        return set().union(*(p for n, p in rec.phases.items() if n == name or n.startswith(name + ".")))

    def place(name: str, child: nn.Module, registered_after: bool) -> None:
        phases = phases_of(name)
        if BETWEEN in phases:
            raise PipelineIncompatibleModel(
                f"{name} holds parameters and runs between or inside the blocks of {path}; a pipeline stage holds "
                f"the modules outside the blocks only before the first block (first stage) or after the last one "
                f"(last stage). Move {name} into the blocks, or train with pipeline_parallel=1"
            )
        if phases == {BEFORE, AFTER}:
            if name not in rec.phases and any(True for _ in child.children()):  # a container of both kinds
                for sub, grandchild in child.named_children():
                    if any(True for _ in grandchild.parameters()):
                        place(f"{name}.{sub}", grandchild, registered_after)
                if any(True for _ in child.parameters(recurse=False)):
                    raise PipelineIncompatibleModel(
                        f"{name} holds parameters of its own and children that run both before and after the blocks "
                        f"of {path}; register those parameters in a child module, or train with pipeline_parallel=1"
                    )
                return
            raise PipelineIncompatibleModel(
                f"{name} holds parameters and runs both before and after the blocks of {path}; the first and the "
                f"last stage would both need it. Use separate modules before and after the blocks (tie their weights "
                f"if they must share them), or train with pipeline_parallel=1"
            )
        after = AFTER in phases or (not phases and registered_after)  # a module that never ran keeps its side
        (post if after else pre).append(name)

    for name, child, registered_after in outside_blocks(module, path):
        place(name, child, registered_after)
    return tuple(pre), tuple(post)
