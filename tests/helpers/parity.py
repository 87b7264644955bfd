"""Run a Lightning fit and record, on every rank, the loss of each step and the final parameters.

Used by parity tests: ``fit_and_record`` on one device and on N fork-started processes with the same
initial model and the same global batches; the test then compares the two records.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset, Sampler


# The documented float32 parity bound (README "Guarantees", docs/guarantees.md): N processes reproduce one
# device's losses within 1e-5 and its parameters within 1e-4 after several AdamW steps. The two runs compute
# the same float32 sums in another association (sharded matmuls, all-reduces, micro-batch means), each
# rounded to 2**-24 relative; through a few layers and steps losses drift by ~1e-7..1e-6, and AdamW, which
# divides each update by that element's gradient RMS, turns rounding noise on near-zero gradients (attention
# key biases, rare-token rows) into parameter differences of up to a few 1e-5, whose exact size depends on
# the CPU and the thread count. A gradient missing, doubled or misplaced moves a parameter by O(lr) >= 1e-3
# per step, ten times the bound; such noise-driven elements are handled by ``assert_param_close``'s outliers.
LOSS_BOUND = 1e-5
PARAM_BOUND = 1e-4


class _Recorder(Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module):
        params = {n: whole(p).detach().cpu().clone() for n, p in pl_module.named_parameters(remove_duplicate=False)}
        record = {"losses": self.losses, "params": params, "global_step": trainer.global_step,
                  "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
        torch.save(record, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as this rank's TP shard (or stage) holds it: a ZeRO-2/3 DTensor is gathered over the
    data-parallel replicas (a collective over them), anything else is returned as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class TensorDataset(Dataset):
    """Items are tuples of tensors indexed along dim 0."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i):
        items = tuple(t[i] for t in self.tensors)
        return items if len(items) > 1 else items[0]


class ReplicaBatches(Sampler):
    """Single-device batches equal to the union of what ``replicas`` data-parallel ranks read.

    Lightning gives every parallel training loader a shuffling ``DistributedSampler`` (seeded with
    ``PL_GLOBAL_SEED``, reshuffled per epoch); rank r reads ``perm[r::replicas]``. Step k of the
    reference run reads batch k of every rank at once, so both runs see the same global batch.
    """

    def __init__(self, n: int, replicas: int, per_rank_batch: int, seed: Optional[int] = None):
        self.n, self.replicas, self.per_rank = n, replicas, per_rank_batch
        self.epoch = 0
        # the sampler's seed: the one given (a loop that seeds after building its loader), else the
        # global seed set so far in this process
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed

    def __len__(self) -> int:
        return -(-self.n // self.replicas) // self.per_rank

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        self.epoch += 1
        perm = torch.randperm(self.n, generator=g).tolist()
        perm += perm[: (-self.n) % self.replicas]  # DistributedSampler pads to a multiple of replicas
        shards = [perm[r :: self.replicas] for r in range(self.replicas)]
        for k in range(len(self)):
            yield [i for s in shards for i in s[k * self.per_rank : (k + 1) * self.per_rank]]


def fit_and_record(
    module: L.LightningModule | Callable[[L.Trainer], L.LightningModule],
    dataset: Dataset,
    batch_size: int,
    out_dir: str,
    devices: int = 1,
    strategy: Any = "auto",
    max_steps: int = 4,
    emulate_replicas: int = 0,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> list[dict]:
    """Fit a deep copy of ``module`` (or the module ``module(trainer)`` builds with the fitting Trainer,
    e.g. under its ``init_module``); return one record per rank (losses, params, global_step).

    ``batch_size`` is per rank. A single-device reference run passes ``emulate_replicas=D`` and
    the global batch size, to read exactly the batches of a run with D data-parallel replicas.
    ``ckpt_path``: resume from that checkpoint (``Trainer.fit``'s argument).
    """
    os.makedirs(out_dir, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=trainer_kwargs.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[_Recorder(out_dir)] + trainer_kwargs.pop("callbacks", []),
        **trainer_kwargs,
    )
    if emulate_replicas:
        sampler = ReplicaBatches(len(dataset), emulate_replicas, batch_size // emulate_replicas)
        loader = DataLoader(dataset, batch_sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    trainer.fit(copy.deepcopy(module) if isinstance(module, L.LightningModule) else module(trainer), loader,
                ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(devices)]


def full_parameters(model: torch.nn.Module, mesh: Any) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as one device holds it: tensor-parallel shards gathered over the
    TP group, the rest detached copies (collective over the TP group when anything is sharded)."""
    from lightning_parallel.tensor_parallel import gather_full_tensor

    return {
        n: gather_full_tensor(p, p.tp_shard, mesh) if hasattr(p, "tp_shard") else p.detach().clone()
        for n, p in model.named_parameters()
    }


def assert_close_series(actual: list[float], expected: list[float], atol: float, rtol: float = 0.0) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=atol, rtol=rtol)


def mean_over_ranks(records: list[dict], key: str = "losses") -> list[float]:
    return torch.tensor([r[key] for r in records]).mean(0).tolist()


def assert_param_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0, name: str = "",
                       outliers: float = 1e-3, outlier_atol: float = 2e-2) -> None:
    """``actual`` equals ``expected`` within ``atol``/``rtol``, but for at most a fraction ``outliers`` of
    the elements (at least one), which stay within ``outlier_atol``.

    AdamW divides each update by the running size of that element's gradient, so an element whose
    gradient is about zero (a softmax shift direction, an embedding row no token used) moves by up to
    lr per step in a direction that rounding decides: two exact runs that sum in different orders can
    disagree there by 2 x lr x steps (2e-2 covers lr 1e-3 for 10 steps). A missing, doubled or
    misplaced gradient moves most of a tensor, and fails.
    """
    actual, expected = actual.to(expected.dtype), expected
    off = (actual - expected).abs() > atol + rtol * expected.abs()
    if not off.any():
        return
    allowed = max(1, int(outliers * expected.numel()))
    if int(off.sum()) > allowed or (actual - expected).abs().max() > outlier_atol:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def assert_params_close(actual: dict, expected: dict, atol: float, rtol: float = 0.0,
                        names: Callable[[str], bool] = lambda n: True) -> None:
    checked = 0
    for name, ref in expected.items():
        if name in actual and names(name):
            assert_param_close(actual[name], ref, atol, rtol, name)
            checked += 1
    assert checked > 0, "no parameter was compared"
