"""Data parallelism: our own bucketed, backward-overlapped gradient all-reduce."""

from lightning_parallel.data_parallel.grad_sync import GradientSynchronizer

__all__ = ["GradientSynchronizer"]
