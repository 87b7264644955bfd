"""Checkpoints in PyTorch Distributed Checkpoint (DCP) format: plain DCP tools read them, and a rank
reads only its share.

The runs, data and tolerances are those of ``test_checkpoint.py`` (the tiny GPT, 6 steps, step s
reads global batch s; resuming on another layout: LOSS_TOL, PARAM_TOL against one device).

Resharding is exact (bytes are copied, never recomputed), so tensors read back are compared with
``torch.equal``.

Bytes read. While a TP2 x PP2 x DP2 checkpoint resumes on TP1 x PP2 x DP4, every file the DCP
reader opens is opened unbuffered and counted, so the count is what the operating system delivered.
Rank r holds its stage's parameters whole, and Adam keeps two moments of each: its share is
3 x (its parameter bytes) plus the ``step`` scalars. The bound asserted is share + the size of
``.metadata``, the index every rank reads (``meta.pt``, Lightning's loop and callback state, is read
by ``torch.load`` and not counted). The stored chunks also carry torch.save's headers (about a kB
each), so a rank that read all its chunks alone would exceed its share; the four replicas of a
stage read disjoint byte ranges, about a quarter each (measured: see README), and exchange them.
"""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_parallel.checkpoint import consolidate
from lightning_parallel.checkpoint.chunks import chunk_view, slice_chunks, tp_chunks
from lightning_parallel.checkpoint.dcp import (
    METADATA,
    local_target,
    read_chunks,
    read_metadata,
    save_chunks,
)
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.tensor_parallel.shard import TPShard, slice_shard
from tests.checkpoint.test_checkpoint import (  # noqa: F401 - reference, tp2pp2_checkpoint: fixtures
    DATASET,
    GLOBAL_BATCH,
    HALF,
    LOSS_TOL,
    assert_continues,
    half_run,
    reference,
    tiny_gpt,
    tp2pp2_checkpoint,
    train,
)
from tests.helpers.processes import run_distributed

_g = torch.Generator().manual_seed(0)
FULL = {"qkv": (torch.randn(18, 4, generator=_g), TPShard(dim=0, fused=3)),  # a rank holds 3 separate row blocks
        "emb": (torch.randn(5, 4, generator=_g), TPShard(dim=0, full_size=5)),  # 6 rows on TP2: rank 1 pads one
        "col": (torch.randn(4, 6, generator=_g), TPShard(dim=1)),
        "norm": (torch.randn(4, generator=_g), None)}
OBJECT = {"optimizer.0.state.norm.flag": ("not", "a tensor")}


def _save_on_tp2_read_on_dp2(rank, world_size, folder):
    chunked = {}
    for name, (full, shard) in FULL.items():
        local = slice_shard(full, shard, rank, 2) if shard is not None else full.clone()
        chunked[name] = (local, tuple(full.shape), tp_chunks(tuple(full.shape), shard, rank, 2))
    written = save_chunks(folder, chunked, OBJECT)
    # the same folder read as TP1 x DP2: both replicas need everything, each reads a part
    metadata = read_metadata(folder)
    targets = {name: local_target(metadata, name, None, 0, 1) for name in FULL}
    objects = read_chunks(folder, metadata, targets, list(OBJECT), dist.group.WORLD)
    return written, {name: local for name, (local, _, _) in targets.items()}, objects


def test_fused_padded_and_split_shards_reshard_from_tp2_to_tp1_and_tp3(tmp_path):
    """The chunk layouts of ``tensor_parallel.shard`` written on TP2 read back whole on DP2 (the
    replicas sharing the reads), cut for each rank of TP3, and whole by plain DCP tools: exactly."""
    results = run_distributed(_save_on_tp2_read_on_dp2, 2, tmp_path)
    assert results[0][0] == ["__0_0.distcp", METADATA] and results[1][0] == ["__1_0.distcp"]
    for _, tensors, objects in results:
        assert objects == OBJECT
        for name, (full, _) in FULL.items():
            assert torch.equal(tensors[name], full), name
    metadata = read_metadata(tmp_path)
    for tp_rank in range(3):
        targets = {name: local_target(metadata, name, (tuple(full.shape), shard), tp_rank, 3)
                   for name, (full, shard) in FULL.items()}
        read_chunks(tmp_path, metadata, targets, [])
        for name, (full, shard) in FULL.items():
            expected = slice_shard(full, shard, tp_rank, 3) if shard is not None else full
            assert torch.equal(targets[name][0], expected), (name, tp_rank)
    dcp_to_torch_save(tmp_path, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert all(torch.equal(plain[name], full) for name, (full, _) in FULL.items())


@pytest.mark.timeout(60)
def test_tp2_pp2_checkpoint_converts_with_dcp_to_torch_save_into_the_unsplit_state_dict(
        tmp_path, tp2pp2_checkpoint, reference):
    out = tmp_path / "plain.pt"
    dcp_to_torch_save(tp2pp2_checkpoint, out)
    converted = torch.load(out, weights_only=False)
    model = tiny_gpt()
    unsplit = model.state_dict()
    model_tensors = {n: converted[n] for n in unsplit}
    assert {n: t.shape for n, t in model_tensors.items()} == {n: t.shape for n, t in unsplit.items()}
    # the same tensors lp-consolidate writes, and the step HALF weights: the next loss is the reference's
    for name, value in consolidate(tp2pp2_checkpoint)["state_dict"].items():
        assert torch.equal(model_tensors[name], value), name
    model.load_state_dict(model_tensors)
    x, y = DATASET[HALF * GLOBAL_BATCH:(HALF + 1) * GLOBAL_BATCH]
    with torch.no_grad():
        assert model._loss((x, y)).item() == pytest.approx(reference["losses"][HALF], abs=LOSS_TOL["atol"])


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_zero1_slices_of_tp_shards_are_chunks_that_tile_the_global_tensor_once(tp_size):
    """Every TP shard of the tensors of ``FULL`` (and of a 3-d one), flattened and cut into ranges
    as ZeRO-1 cuts buckets, gives chunks that hold exactly the global elements of their range: over
    all ranks and ranges, each element of the global tensor once, with its value."""
    tensors = {**FULL, "cube": (torch.randn(3, 4, 5, generator=_g), None)}
    for name, (full, shard) in tensors.items():
        if shard is not None and shard.full_size is None and full.shape[shard.dim] % (tp_size * shard.fused):
            continue
        seen = torch.zeros(full.shape, dtype=torch.int64)
        for tp_rank in range(tp_size if shard is not None else 1):  # a replicated tensor: each TP rank holds it all
            local = slice_shard(full, shard, tp_rank, tp_size) if shard is not None else full.clone()
            n = local.numel()
            cuts = sorted({0, n, 1, n // 3, n // 2 + 1, n - 2} & set(range(n + 1)))  # rows cut anywhere
            for begin, end in zip(cuts, cuts[1:]):
                flat = local.reshape(-1)[begin:end].clone()
                for chunk in slice_chunks(tuple(full.shape), shard, tp_rank, tp_size, begin, end - begin):
                    box = tuple(slice(o, o + size) for o, size in zip(chunk.offsets, chunk.sizes))
                    assert torch.equal(chunk_view(flat, chunk), full[box]), (name, tp_rank, begin, end, chunk)
                    seen[box] += 1
        assert torch.equal(seen, torch.ones_like(seen)), name


class _CountedFile(io.RawIOBase):
    """An unbuffered file that logs ``(offset, bytes)`` of every read."""

    def __init__(self, raw: io.FileIO, log: list[tuple[int, int]]):
        super().__init__()
        self.raw, self.log = raw, log

    def readinto(self, b) -> int:
        offset, n = self.raw.tell(), self.raw.readinto(b)
        self.log.append((offset, n or 0))
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def _loading() -> bool:
    return any(frame.name == "load_sharded" for frame in traceback.extract_stack())


def _counting_streams(log_dir: Path):
    """``FileSystem.create_stream`` that counts the reads of ``load_sharded`` into ``log_dir/rank<r>.txt``
    (one line per read; the launcher's consolidation of the trained weights on rank 0 is not counted)."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode != "rb" or not _loading():
            with real(self, path, mode) as stream:
                yield stream
            return
        log: list[tuple[int, int]] = []
        with open(path, "rb", buffering=0) as raw:
            yield _CountedFile(raw, log)
        with open(log_dir / f"rank{dist.get_rank()}.txt", "a") as f:
            f.writelines(f"{Path(path).name} {offset} {n}\n" for offset, n in log)

    return create_stream


def _world_gathers_while_loading(log_dir: Path):
    """``dist.all_gather_object`` that notes each call over the whole world made from ``load_sharded``."""
    real = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        if group is None and _loading():
            with open(log_dir / f"world_gathers{dist.get_rank()}.txt", "a") as f:
                f.write("all_gather_object over the world\n")
        return real(object_list, obj, group=group)

    return all_gather_object


def _reads(log_dir: Path, rank: int) -> list[tuple[str, int, int]]:
    lines = (log_dir / f"rank{rank}.txt").read_text().split()
    return [(lines[i], int(lines[i + 1]), int(lines[i + 2])) for i in range(0, len(lines), 3)]


@pytest.mark.timeout(120)
def test_tp2_pp2_dp2_checkpoint_resumes_on_pp2_dp4_each_rank_reading_at_most_its_share(
        tmp_path, monkeypatch, reference):
    checkpoint = half_run(tmp_path / "saved", devices=8, tp=2, pp=2)
    files = sorted(p.name for p in checkpoint.iterdir())
    assert files == sorted([METADATA, "complete.json", "meta.pt", *(f"__{r}_0.distcp" for r in range(8))])
    # every rank wrote a part, and nothing twice: the files hold exactly the chunks the index lists once each
    written = [(checkpoint / f"__{r}_0.distcp").stat().st_size for r in range(8)]
    assert all(written) and sum(written) == sum(s.length for s in read_metadata(checkpoint).storage_data.values())
    log_dir = tmp_path / "reads"
    log_dir.mkdir()
    monkeypatch.setattr(FileSystem, "create_stream", _counting_streams(log_dir))  # inherited by the forked ranks
    monkeypatch.setattr(dist, "all_gather_object", _world_gathers_while_loading(log_dir))
    records = train(tmp_path / "resumed", devices=8, pp=2, ckpt_path=checkpoint)
    monkeypatch.undo()

    assert_continues(records, reference)  # parity: the uninterrupted single-device run
    assert not list(log_dir.glob("world_gathers*")), "names travelled by all_gather_object over the whole world"
    mesh = ParallelMesh(8, pipeline_parallel=2)
    metadata_bytes = (checkpoint / METADATA).stat().st_size
    stages = {}
    for rank, record in enumerate(records):
        reads = _reads(log_dir, rank)
        data = [(file, offset, n) for file, offset, n in reads if file != METADATA and n]
        share = 3 * sum(p.numel() * p.element_size() for p in record["params"].values()) + 4 * len(record["params"])
        assert sum(n for _, _, n in data) <= share, (rank, sum(n for _, _, n in data), share)
        assert sum(n for file, _, n in reads if file == METADATA) <= metadata_bytes
        stages.setdefault(mesh.coords(rank).pp, []).append(data)
    for stage, replicas in stages.items():
        assert len(replicas) == 4
        seen: dict[str, list[tuple[int, int]]] = {}
        for data in replicas:  # no byte is read by two replicas of a stage
            for file, offset, n in data:
                for a, b in seen.get(file, []):
                    assert offset + n <= a or b <= offset, f"stage {stage}: {file} [{offset}, {offset + n}) read twice"
            for file, offset, n in data:
                seen.setdefault(file, []).append((offset, offset + n))
        assert all(replicas), f"stage {stage}: a replica read nothing, the reads were not shared"
