"""The plan in force, as a table (module glob, style, local parameter shapes), and a plan as
YAML text a user can check and give as ``strategy.tp_plan``."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from .plan import Plan, PlanEntry

if TYPE_CHECKING:
    from .resolve import Assignment


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # params: (name, dim) pairs
        return "{" + ", ".join(f"{n}: {d}" for n, d in value) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    return str(value)


def _yaml_entry(entry: PlanEntry) -> str:
    """Every field that differs from its default; a bare style name when that is all there is."""
    default = PlanEntry()
    parts = [
        f"{f.name}: {_yaml_value(getattr(entry, f.name))}"
        for f in dataclasses.fields(entry)
        if getattr(entry, f.name) != getattr(default, f.name)
    ]
    return parts[0].removeprefix("style: ") if len(parts) == 1 and entry.style else "{" + ", ".join(parts) + "}"


def plan_as_yaml(plan: Plan) -> str:
    """``plan`` as the YAML block of a Hydra config's ``strategy.tp_plan`` (globs quoted: ``*``
    opens an alias in YAML)."""
    return "tp_plan:\n" + "".join(f"  {json.dumps(glob)}: {_yaml_entry(e)}\n" for glob, e in plan.items())


def plan_table(assignments: list[Assignment], tp_size: int, sequence_parallel: bool) -> Table:
    """One row per glob (repeated layers share a row), shapes as held by this rank."""
    title = f"tensor parallel plan: tp={tp_size}" + (", sequence parallel" if sequence_parallel else "")
    table = Table(title=title)
    table.add_column("module", overflow="fold")
    table.add_column("style", overflow="fold")
    table.add_column("local shape", overflow="fold")
    table.add_column("matches", justify="right")
    rows: dict[str, list] = {}
    for a in assignments:
        if a.glob in rows:
            rows[a.glob][3] += 1
            continue
        own = a.module.named_parameters(recurse=a.entry.style == "attention")  # a whole attention lists its parts
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own if hasattr(p, "tp_shard"))
        rows[a.glob] = [a.glob, a.entry.describe(), shapes or "-", 1]
    for glob, style, shapes, count in rows.values():
        table.add_row(glob, style, shapes, str(count))
    return table


def print_plan(assignments: list[Assignment], tp_size: int, sequence_parallel: bool) -> None:
    Console().print(plan_table(assignments, tp_size, sequence_parallel))
