"""Byte-level language-modelling data that needs no download.

Every byte is a token (vocabulary 256), so any text works and no tokenizer is involved. The
default corpus is the Python standard library's own `.py` sources, present on every machine
that runs this package. Items are pure functions of their index, so Lightning's
`DistributedSampler` can shard them across data-parallel ranks and every pipeline or tensor
parallel rank of one replica sees the same batch.

Resuming mid-epoch continues the epoch where the checkpoint left it: the data module saves how
many batches of the current epoch the fit loop had taken, and the first epoch after a resume
skips that many batches of indices (no data is read for them), so a resumed run trains on the
very batches the uninterrupted run would have (`ResumingSampler`).
"""

from __future__ import annotations

import itertools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB_SIZE = 256


def text_files(path: str | Path | None) -> list[Path]:
    """The files to read, in a fixed order: `path` itself, every file under it, or the stdlib."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        # site-packages often lives under the stdlib folder; its content differs per machine, and
        # it can hold far more files than the stdlib, so it is not even walked.
        files = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
            files += [Path(folder) / n for n in names if n.endswith(".py")]
        return sorted(files)
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"text path {root} is neither a file nor a folder")
    return sorted(p for p in root.rglob("*") if p.is_file())


def load_bytes(path: str | Path | None, max_bytes: int) -> torch.Tensor:
    """Concatenate the files' bytes, stopping once `max_bytes` are read, as a uint8 tensor."""
    chunks, total = [], 0
    for f in text_files(path):
        chunk = f.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class RandomWindows(Dataset):
    """`num_samples` windows at random offsets, fixed at construction by `seed`.

    Item i is `(x, y)` with `x = data[o:o+T]`, `y = data[o+1:o+T+1]` (int64), where the offset
    `o` depends only on `(seed, i)`.
    """

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int):
        self.data, self.block_size = data, block_size
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(data) - block_size, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = int(self.offsets[i])
        window = self.data[o : o + self.block_size + 1].long()
        return window[:-1], window[1:]


class ContiguousWindows(Dataset):
    """Non-overlapping consecutive windows from the start of `data`, at most `max_samples`."""

    def __init__(self, data: torch.Tensor, block_size: int, max_samples: int):
        self.data, self.block_size = data, block_size
        self.length = min(max_samples, (len(data) - 1) // block_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = i * self.block_size
        window = self.data[o : o + self.block_size + 1].long()
        return window[:-1], window[1:]


class ResumingSampler(DistributedSampler):
    """One data-parallel replica's share of the indices, in order; the first pass starts ``skip`` in.

    The windows are already at random offsets, so the order is not shuffled: one process, or N
    replicas together, read the same windows in the same order (replica r takes positions r, r+N,
    ...), and Lightning, which shuffles the sampler it would inject for training, sees this one
    already in place. After a resume, ``skip`` is the replica's samples already trained on.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, skip: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class TextDataModule(L.LightningDataModule):
    """Byte-level next-token data from a file, a folder of files, or (default) the stdlib.

    The first `1 - val_fraction` of the bytes train, the rest validate, so no validation text
    is ever trained on. `train_samples` sets the epoch length (random windows);
    `val_samples` caps the validation windows.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        max_bytes: int = 2_000_000,
        train_samples: int = 100_000,
        val_samples: int = 1024,
        num_workers: int = 0,
        seed: int = 1337,
    ):
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
        self.save_hyperparameters()
        self._resume_batches = 0

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        data = load_bytes(hp.path, hp.max_bytes)
        n_val = int(len(data) * hp.val_fraction)
        train, val = data[: len(data) - n_val], data[len(data) - n_val :]
        shortest = min(len(train), len(val))
        if shortest <= hp.block_size:
            raise ValueError(
                f"{len(data)} bytes split by val_fraction={hp.val_fraction} leave {shortest} bytes "
                f"in one split; each split needs more than block_size={hp.block_size}. Use more "
                f"text, a smaller block_size, or a val_fraction nearer 0.5"
            )
        self.train_set = RandomWindows(train, hp.block_size, hp.train_samples, hp.seed)
        self.val_set = ContiguousWindows(val, hp.block_size, hp.val_samples)

    def train_dataloader(self) -> DataLoader:
        # the data-parallel share Lightning would give (one replica on one process)
        shares = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        shares = shares or {"num_replicas": 1, "rank": 0}
        skip, self._resume_batches = self._resume_batches, 0
        sampler = ResumingSampler(self.train_set, skip=skip * self.hparams.batch_size, **shares)
        return DataLoader(self.train_set, sampler=sampler, batch_size=self.hparams.batch_size, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def state_dict(self) -> dict[str, int]:
        """Batches of the current epoch the fit loop has taken (saved in every checkpoint)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        return {"epoch_batches": trainer.fit_loop.epoch_loop.batch_progress.current.ready,
                "batches_per_epoch": trainer.num_training_batches}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Makes the next training epoch start after the batches the checkpoint had taken.

        Both counts are one replica's batches; an epoch that had ended leaves nothing to skip.
        """
        taken = state_dict.get("epoch_batches", 0)
        self._resume_batches = 0 if taken >= state_dict.get("batches_per_epoch", 0) else taken

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers
        )
