"""Random numbers in a training forward, made comparable between one process and a split run.

Some architectures draw random numbers in their training forward even with every dropout at 0: a
router that samples its experts, noise added to router logits, a dropout the config calls by a name
nobody zeroes. One process and a split run then draw different numbers (tensor parallelism takes one
draw per split region for its per-rank streams, a pipeline runs each micro-batch on its own), so the
losses differ whether or not the split is right: comparing them step for step would report parity or
wrong by chance.

``KeyedDraws`` makes the draws identical where they can be: inside it, every operation that draws
from the random generator (an ATen operator tagged ``nondeterministic_seeded``: ``bernoulli``,
``multinomial``, ``native_dropout``, ``uniform_``, ...) first reseeds the generator from where it is
made: the training step, the innermost module running, the operator and how many times that module
called it in the step. Operators that may draw but did not (attention without dropout) are not counted. A draw on a replicated activation (a router's input, the residual stream) is
then the same in every run. A draw on a split activation (dropout on one rank's heads, one
micro-batch) cannot be: there the operator sees another shape than on one process, which
``unmatched`` reports, and the zoo calls the model ``random`` instead of comparing it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class KeyedDraws(TorchDispatchMode):
    """Reseed the default CPU generator before each random operator, from where it is drawn.

    Enter it around ``trainer.fit`` (fork-started ranks inherit it); call ``start_step`` at the start
    of each training batch (``Record`` does). ``summary()`` lists the draws of the training steps
    (key -> shape of the operator's first tensor argument).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.step: Optional[int] = None
        self.names: dict[int, str] = {}
        self.running: list[str] = []
        self.counts: Counter = Counter()
        self.shapes: dict[str, list[int]] = {}
        self.reference: Optional[dict[str, list[int]]] = None
        self._hooks: list = []

    def start_step(self, step: int, module: nn.Module) -> None:
        """A training step begins on ``module`` (its names after any split)."""
        self.step, self.counts = step, Counter()
        self.names = {id(m): name for name, m in module.named_modules()}

    def __enter__(self):
        register = torch.nn.modules.module
        self._hooks = [register.register_module_forward_pre_hook(self._enter_module),
                       register.register_module_forward_hook(self._leave_module, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self.step = None
        return super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, args) -> None:
        self.running.append(self.names.get(id(module), type(module).__name__))

    def _leave_module(self, module: nn.Module, args, output) -> None:
        if self.running:
            self.running.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.step is not None and torch.Tag.nondeterministic_seeded in func.tags:
            where = self.running[-1] if self.running else "(step)"
            self.counts[(where, func.name())] += 1
            key = f"{self.step}|{where}|{func.name()}|{self.counts[(where, func.name())]}"
            seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
            torch.default_generator.manual_seed(seed)
            seeded = torch.get_rng_state()
            out = func(*args, **kwargs)
            if not torch.equal(seeded, torch.get_rng_state()):  # it drew (attention without dropout does not)
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                self.shapes[key] = list(first.shape) if first is not None else []
            return out
        return func(*args, **kwargs)

    def summary(self) -> dict[str, list[int]]:
        return dict(self.shapes)

    def freeze(self, reference: dict) -> None:
        """Keep the one-process run's draws (its record) to check the split runs' against."""
        self.reference = reference["draws"]
        self.shapes = {}

    def unmatched(self, records: list[dict]) -> Optional[str]:
        """Why the ranks' draws (their records) cannot equal the one-process run's, or None."""
        for rank, record in enumerate(records):
            drawn = record.get("draws") or {}
            for key, shape in drawn.items():
                want = self.reference.get(key)
                if want != shape:
                    step, where, op, _ = key.split("|")
                    seen = f"{tuple(want)} on one process" if want is not None else "nothing on one process"
                    return (f"the training forward draws random numbers ({op} in {where}) on {tuple(shape)} on "
                            f"rank {rank}, {seen}: split or micro-batched, its draws cannot equal one process's")
        return None
