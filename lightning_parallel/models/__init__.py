"""Plain LightningModules shipped as defaults; they import nothing from lightning_parallel."""

from lightning_parallel.models.gpt import GPT

__all__ = ["GPT"]
