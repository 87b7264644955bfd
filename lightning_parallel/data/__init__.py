"""Data modules shipped as defaults; they need no download."""

from lightning_parallel.data.text import TextDataModule

__all__ = ["TextDataModule"]
