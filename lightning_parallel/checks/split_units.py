"""Which modules the split check compares, and the whole copies it compares them with.

A tensor-parallel plan splits modules inside repeated blocks (a decoder layer's attention and MLP)
and a few outside them (a vocabulary-parallel embedding, a column-parallel head). The check runs
one *unit* of each kind whole and split: a unit is the outermost element of an ``nn.ModuleList`` or
``nn.Sequential`` holding split modules (a block), or, outside such lists, the split module itself
where its input and output are whole on every rank (an embedding, a gathered head, a whole
attention), else the module holding a column-parallel layer and the row-parallel one it feeds (an
MLP written as two sibling Linears). Blocks of one kind (same class, parameter shapes, plan inside
and plain settings) run the same code on different values, so the first of each kind stands for
all: the cost of the check does not grow with depth.

The whole copy of a unit is taken before the split, with its parameters on the meta device (no
memory): its structure and buffers as they were; its values come later from the split model itself
(``verify_split.py``), whichever way the weights were made. Pure: reads modules only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from torch import nn

from lightning_parallel.tensor_parallel.names import inside

# styles whose module takes and returns whole activations on every rank (None: an attention whose
# stored head count is divided), so it can run on its own
_SELF_CONTAINED = ("vocab", "attention", "moe_experts", "all_reduce", None)
# plain settings that number a layer rather than change what it computes
_POSITION_WORDS = ("idx", "index", "layer_id", "layer_number", "layer_num")


@dataclass
class Unit:
    """One module the check runs whole and split: its name, its whole copy (meta parameters), the
    split modules inside it and its parts (submodules holding split modules, which a unit found
    wrong is searched down to), both relative to it."""

    name: str
    whole: nn.Module
    split: tuple[str, ...]
    parts: tuple[str, ...] = ()

    def part_names(self) -> list[str]:
        """The unit and its parts, as names in the model."""
        return [self.name] + [f"{self.name}.{p}" if self.name else p for p in self.parts]


def _parts(split: tuple[str, ...]) -> tuple[str, ...]:
    """The split modules of a unit and every module between them and the unit, outermost first."""
    found: dict[str, None] = {}
    for name in filter(None, split):  # "": the unit is the split module itself
        pieces = name.split(".")
        for end in range(1, len(pieces) + 1):
            found[".".join(pieces[:end])] = None
    return tuple(sorted(found, key=lambda n: n.count(".")))


def _list_element(name: str, containers: set[str]) -> Optional[str]:
    """The outermost ancestor of ``name`` (or ``name`` itself) that is an element of a list."""
    parts = name.split(".")
    for end in range(1, len(parts) + 1):
        parent = ".".join(parts[: end - 1])
        if parent in containers:
            return ".".join(parts[:end])
    return None


def self_contained(entry) -> bool:
    """Whether a module split by plan ``entry`` takes and returns whole activations on every rank."""
    return entry.style in _SELF_CONTAINED or entry.gather_output or entry.split_input


def unit_of(name: str, entry, containers: set[str]) -> str:
    """The unit a split module ``name`` (with plan ``entry``) is checked in (see the module docstring)."""
    element = _list_element(name, containers)
    if element is not None:
        return element
    return name if self_contained(entry) else name.rpartition(".")[0]


def _settings(module: nn.Module) -> tuple:
    """The plain values (numbers, flags, strings) a module and its submodules hold, but layer numbers."""
    found = []
    for sub_name, sub in module.named_modules():
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key == "training" or any(w in key.lower() for w in _POSITION_WORDS):
                continue
            if isinstance(value, (bool, int, float, str)) or value is None:
                found.append((sub_name, key, value))
    return tuple(found)


def kind_of(module: nn.Module, split: tuple[str, ...]) -> tuple:
    """What makes two units run the same code: class, parameter shapes, split modules, settings."""
    params = tuple((n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters())
    return type(module).__qualname__, params, split, _settings(module)


def whole_copy(root: nn.Module, name: str) -> nn.Module:
    """A copy of the module ``name`` with its parameters on the meta device and its buffers as they
    are; references it holds to modules outside itself stay shared."""
    module = root.get_submodule(name)
    memo: dict = {id(m): m for n, m in root.named_modules() if not inside(n, name)}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo)


def choose_units(root: nn.Module, assignments: list) -> list[Unit]:
    """One unit of each kind, in module order, for the split modules of a resolved plan
    (``tensor_parallel.resolve.Assignment``), each with its whole copy. Call it before the split."""
    containers = {n for n, m in root.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))}
    inner: dict[str, list[str]] = {}
    for a in assignments:
        if a.entry.style != "sequence_scatter":  # left whole: its output only enters the split region
            inner.setdefault(unit_of(a.name, a.entry, containers), []).append(a.name)
    names = [u for u in inner if not any(o != u and inside(u, o) for o in inner)]
    for u in names:  # a unit inside another unit is checked as part of it
        for o in inner:
            if o != u and inside(o, u):
                inner[u] += inner[o]
    units: list[Unit] = []
    kinds: set = set()
    order = {n: i for i, (n, _) in enumerate(root.named_modules())}
    for name in sorted(names, key=lambda n: order.get(n, len(order))):
        module = root.get_submodule(name)
        relative = tuple(sorted(n[len(name) + 1:] if name else n for n in inner[name]))
        kind = kind_of(module, relative)
        if kind in kinds:
            continue
        kinds.add(kind)
        units.append(Unit(name, whole_copy(root, name), relative, _parts(relative)))
    return units
