"""Choosing a layout: read the model's costs (``profile``), enumerate the layouts (``space``), predict
their step time (``cost``, with rates from ``calibrate``), rank them (``search``). Pure logic on a model
built on the meta device."""

from lightning_parallel.planner.search import (
    PlanError,
    SearchResult,
    explain,
    format_table,
    search,
)
from lightning_parallel.planner.space import Cluster, Constraints, Layout, Workload

__all__ = ["Cluster", "Constraints", "Layout", "PlanError", "SearchResult", "Workload", "explain", "format_table",
           "search"]
