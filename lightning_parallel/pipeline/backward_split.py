"""Split one stage's backward into an input-gradient pass (B) and a weight-gradient pass (W).

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241)
send a stage's input gradient upstream as soon as it exists and compute the weight gradients
later, in what would otherwise be a bubble. Nothing is computed twice:

* **B** runs the autograd engine from the stage's output (or loss) to its received input only,
  so every node on that path computes only the gradient that flows towards the input (a linear
  layer computes ``grad @ W``, not ``x^T @ grad``). The graph is kept. Pre-hooks on the nodes of
  that path that also lead to weights ("intermediates") record the gradients arriving there.
* **W** restarts the engine at those intermediates with the recorded gradients, towards the
  leaves (parameters) only, so each intermediate now computes only its weight-side outputs, and
  the leaves accumulate into ``.grad`` through their ``AccumulateGrad`` nodes, exactly as in one
  full backward: ``register_post_accumulate_grad_hook`` fires once per parameter and micro-batch.

Intermediates whose weights overlap (a weight used twice in one stage) form one group and one
engine call; where one of them lies on another's input path that call also walks the path in
between, and a pre-hook pins each intermediate's gradient to the recorded one so nothing is
counted twice. The same idea as ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight``.

What a B keeps alive until its W: the whole graph of the micro-batch (the activations its weight
gradients need, plus those only the input path needed, freed together when W ends), as an unsplit
backward would hold it until it ran, and the gradients recorded at the intermediates (for a GPT
block about two thirds of its saved activations). Gradient hooks on *intermediate* tensors
(``Tensor.register_hook``) run in both passes. Activation checkpointing recomputes its region in
B, and would again in each engine call of W: ``WeightPass.recomputed`` says so, and the engine then
runs whole backwards. Reentrant checkpointing cannot run a partial backward at all
(``SplitUnsupported``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.nn.modules.module import register_module_forward_pre_hook

from lightning_parallel.compat import autograd_engine, in_backward


class SplitUnsupported(RuntimeError):
    """The graph refuses a partial backward (e.g. reentrant activation checkpointing)."""


def _leaf_node(t: torch.Tensor) -> Node:
    """The ``AccumulateGrad`` node of a leaf that requires grad (created on first use)."""
    return t.view_as(t).grad_fn.next_functions[0][0]


def _graph(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from ``roots``, each after all nodes that lead to it (reverse topological)."""
    order, seen, stack = [], set(), [(r, False) for r in roots if r is not None]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in seen)
    order.reverse()  # post-order reversed: parents (towards the output) before children
    return order


class WeightPass:
    """The deferred weight-gradient pass of one micro-batch on one stage; call it once.

    ``groups``: (roots, leaves, pinned) per engine call; a root is a ``GradientEdge`` with its
    gradient; ``pinned``, for groups of several intermediates, their recorded gradients.
    ``recomputed``: whether a module's forward ran again during the input pass (activation
    checkpointing), which each engine call of this pass repeats.
    """

    def __init__(self, groups: list[tuple[list[tuple[GradientEdge, torch.Tensor]], list[torch.Tensor], dict]],
                 recomputed: bool = False):
        self.groups, self.recomputed = groups, recomputed

    def __call__(self) -> None:
        engine = autograd_engine()
        groups, self.groups = self.groups, []  # the graph can go once this pass is done
        for k, (roots, leaves, pinned) in enumerate(groups):
            keep = k < len(groups) - 1  # a group may walk nodes a later group needs (a weight used twice)
            pins = [node.register_prehook(lambda _g, saved=saved: saved) for node, saved in pinned.items()]
            try:
                engine.run_backward(tuple(e for e, _ in roots), tuple(g for _, g in roots), keep, False,
                                    tuple(leaves), True, True)
            finally:
                for pin in pins:
                    pin.remove()


def backward_input(roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor],
                   received: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], WeightPass]:
    """Gradient of ``received`` from ``roots`` (with ``root_grads``), and the pass that finishes the weights.

    Without a received input (the first stage) nothing is computed now; the weight pass is then the
    whole backward.
    """
    root_edges = [(get_gradient_edge(r), g) for r, g in zip(roots, root_grads)]
    order = _graph([e.node for e, _ in root_edges])
    leaves = {node: node.variable for node in order if isinstance(getattr(node, "variable", None), torch.Tensor)}
    if received is None:
        return None, WeightPass([(root_edges, list(leaves.values()), {})] if leaves else [])
    input_node = _leaf_node(received)
    leaves.pop(input_node, None)
    # nodes that lead to the input; then, off that path, the leaves each node leads to
    to_input = {input_node}
    for node in reversed(order):  # children before parents
        if any(n in to_input for n, _ in node.next_functions):
            to_input.add(node)
    to_leaf: dict[Node, frozenset] = {}
    for node in reversed(order):
        if node in to_input:
            continue
        reached = {node} if node in leaves else set()
        for n, _ in node.next_functions:
            reached |= to_leaf.get(n, frozenset())
        if reached:
            to_leaf[node] = frozenset(reached)
    # intermediates: nodes on the input path with an edge into weights-only territory
    weight_side: dict[Node, frozenset] = {}
    for node in order:
        if node in to_input:
            reached = frozenset().union(*(to_leaf.get(n, frozenset()) for n, _ in node.next_functions))
            if reached:
                weight_side[node] = reached
    captured: dict[Node, tuple] = {}
    position = {id(t): k for k, t in enumerate(leaves.values())}  # backward order, output side first

    def record(node: Node):
        def hook(grad_outputs):
            captured[node] = tuple(grad_outputs)
        return hook

    recomputed = []

    def forward_in_backward(_module, _args):
        if in_backward():
            recomputed.append(True)

    handles = [n.register_prehook(record(n)) for n in weight_side]
    handles.append(register_module_forward_pre_hook(forward_in_backward))
    on_path = [(r, g) for r, g in zip(roots, root_grads) if r.grad_fn in to_input]
    try:
        grad = None
        if on_path:
            (grad,) = autograd_engine().run_backward(tuple(r for r, _ in on_path), tuple(g for _, g in on_path),
                                                     True, False, (received,), True, False)
    except RuntimeError as err:
        raise SplitUnsupported(str(err)) from err
    finally:
        for h in handles:
            h.remove()
    groups = []
    for nodes in _group(weight_side, order):
        edges = [(GradientEdge(n, i), g) for n in nodes for i, g in enumerate(captured.get(n, ())) if g is not None]
        pinned = {n: captured[n] for n in nodes if n in captured} if len(nodes) > 1 else {}
        reached = frozenset().union(*(weight_side[n] for n in nodes))
        groups.append((edges, sorted((leaves[leaf] for leaf in reached), key=lambda t: position[id(t)]), pinned))
    off_path = [(e, g) for e, g in root_edges if e.node not in to_input and e.node in to_leaf]
    if off_path:  # a root that does not lead to the input at all (a loss term of weights only)
        reached = frozenset().union(*(to_leaf[e.node] for e, _ in off_path))
        groups.append((off_path, sorted((leaves[leaf] for leaf in reached), key=lambda t: position[id(t)]), {}))
    grad = grad if grad is not None else torch.zeros_like(received)
    return grad, WeightPass([g for g in groups if g[0]], bool(recomputed))


def _group(weight_side: dict[Node, frozenset], order: list[Node]) -> list[list[Node]]:
    """Intermediates joined when they reach a common leaf; groups in backward order (output side first)."""
    parent: dict[Node, Node] = {n: n for n in weight_side}

    def find(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    owner: dict[Node, Node] = {}
    for node, reached in weight_side.items():
        for leaf in reached:
            if leaf in owner:
                parent[find(node)] = find(owner[leaf])
            else:
                owner[leaf] = node
    members: dict[Node, list[Node]] = {}
    for node in order:  # the output side first, as one full backward accumulates
        if node in weight_side:
            members.setdefault(find(node), []).append(node)
    return list(members.values())
