"""The plan in force, as a table: module glob, style, local parameter shapes."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .resolve import Assignment


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
