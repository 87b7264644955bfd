"""One family for every error this package raises on purpose.

Each message states the constraint that was violated and what would work. Catch
``LightningParallelError`` for all of them, or one area:

- ``ConfigurationError``: options that cannot work together (a schedule name, a micro-batch count,
  a config file path, a plan's syntax);
- ``LaunchError``: the processes and the layout do not fit (the SLURM allocation, the product of the
  sizes, a TP group across nodes, a model that does not divide into them), found before any
  collective, the same on every rank;
- ``IncompatibleModelError``: the model cannot be split or trained as asked (no block list, blocks
  that run twice, nothing a tensor-parallel plan splits);
- ``CheckpointError``: a checkpoint that cannot be written, or does not match the model it is
  loaded into.

Configuration and model errors are also ``ValueError``s, as they were before the family existed.
"""

from __future__ import annotations


class LightningParallelError(Exception):
    """Base class of the package's errors; the message says what to change."""


class ConfigurationError(LightningParallelError, ValueError):
    """Options, or a composed config, that cannot work together."""


class LaunchError(LightningParallelError, ValueError):
    """A launch whose allocation, layout and model do not fit together."""


class IncompatibleModelError(LightningParallelError, ValueError):
    """A model that cannot be split or trained the way the strategy was asked to."""


class CheckpointError(LightningParallelError):
    """A checkpoint that cannot be written, or that does not fit the model it is loaded into."""
