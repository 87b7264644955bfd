"""Save and load sharded checkpoints from a ``ParallelStrategy`` (every rank calls these).

A checkpoint path becomes a directory: ``meta.pt`` holds what Lightning saves besides weights
(epoch, global step, loops, callbacks, LR schedulers, hyper-parameters) and the layout it was
written on; ``pp{p}-tp{t}.pt`` holds the tensors and optimizer state of pipeline rank p and TP
rank t under global names (written by data-parallel rank 0 only; the replicas are identical).
Loading reads every piece and reshards it onto the current layout (``format.py``), so a run may
resume on a different number of processes or a different split. A plain ``.ckpt`` file (one
device, or ``lp-consolidate``'s output) loads through the same path as a single piece.

Saving replaces a directory only once every rank has written its pieces, and loading reads only a
complete directory (``atomic.py``), so a crash or a full disk during a save never costs the
previous checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.checkpoint.atomic import MARKER, folder_to_read, save_pieces, write_file
from lightning_parallel.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointMismatchError,
    Piece,
    decode_layout,
    encode_layout,
    full_optimizer_state,
    full_tensor,
    global_shape,
    index_optimizer_state,
    local_optimizer_state,
    local_tensor,
    mismatches,
    name_optimizer_state,
    saved_shapes,
    unexpected,
)
from lightning_parallel.data_parallel.zero import configured_param_groups

META_FILE = "meta.pt"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def holds_checkpoint_files(path: Path) -> bool:
    """Whether directory ``path`` holds any file of a sharded checkpoint, complete or not."""
    return any((path / name).is_file() for name in (META_FILE, MARKER)) or any(path.glob("pp*-tp*.pt"))


def piece_file(pp_rank: int, tp_rank: int) -> str:
    return f"pp{pp_rank:03d}-tp{tp_rank:03d}.pt"


# ---- names shared by both directions ---------------------------------------------------------
def parameter_names(module: nn.Module, pipeline: Any, mesh: Any) -> dict[int, str]:
    """``id(param) -> name`` for every local parameter, by its first name in the unsplit model.

    A weight tied across pipeline stages has a different local name on each stage (the embedding
    on the first, the head on the last); all stages agree on the first stage's name. Both sides
    list their tied weights in the same order (``PipelineEngine.tied``), so the k-th tied weight
    shared by stages R on one stage is the k-th one shared by R on every other. Collective over
    the pipeline group.
    """
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    if pipeline is None or mesh.pp_size == 1:
        return names
    mine = [(tuple(ranks), names[id(param)]) for param, _, ranks in pipeline.tied]
    every: list[Any] = [None] * mesh.pp_size
    dist.all_gather_object(every, mine, group=mesh.pp_group)
    seen: dict[tuple[int, ...], int] = {}
    for param, _, ranks in pipeline.tied:
        ranks = tuple(ranks)
        k = seen.get(ranks, 0)
        seen[ranks] = k + 1
        names[id(param)] = [n for r, n in every[ranks[0]] if r == ranks][k]
    return names


def _stage_order(module: nn.Module, pipeline: Any, names: dict[int, str]) -> dict[str, tuple[int, int]]:
    """``name -> (stage, position)`` of the local parameters (root parameters come first: stage -1)."""
    stages = pipeline.plan.module_stages() if pipeline is not None else {}
    order = {}
    for position, (local_name, p) in enumerate(module.named_parameters()):
        prefixes = [m for m in stages if local_name.startswith(m + ".")]
        stage = stages[max(prefixes, key=len)] if prefixes else (0 if pipeline is None else -1)
        order[names[id(p)]] = (stage, position)
    return order


def _layouts(module: nn.Module, tensors: dict[str, torch.Tensor], tp_size: int) -> dict[str, Any]:
    params = dict(module.named_parameters(remove_duplicate=False))
    layouts = {}
    for name, t in tensors.items():
        shard = getattr(params.get(name), "tp_shard", None)
        layouts[name] = (global_shape(t.shape, shard, tp_size), shard)
    return layouts


def _group_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    # as configured: under ZeRO-1 the optimizer steps on slices, its state is saved by parameter
    return [[names[id(p)] for p in group] for group in configured_param_groups(optimizer)]


# ---- save ------------------------------------------------------------------------------------
def save_sharded(strategy: Any, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Write ``checkpoint`` (Lightning's dict, from this rank) as a sharded checkpoint directory.

    It replaces an existing checkpoint only once every piece is written (``atomic.save_pieces``); if
    any rank fails, every rank raises ``CheckpointSaveError`` and the previous checkpoint stays.
    """
    path = Path(strategy.broadcast(str(filepath)))
    mesh, module = strategy.mesh, strategy.lightning_module
    foreign = path.is_dir() and not holds_checkpoint_files(path) and any(path.iterdir())
    if strategy.broadcast(foreign):  # rank 0's view, so that every rank raises
        raise IsADirectoryError(f"the checkpoint path {path} is a directory that is not a checkpoint; choose another")
    names = parameter_names(module, strategy.pipeline, mesh)
    rest = dict(checkpoint)
    tensors = rest.pop("state_dict")
    optimizer_states = rest.pop("optimizer_states", None)

    def write(folder: Path) -> list[str]:
        if mesh.dp_rank != 0:
            return []
        piece: dict[str, Any] = {
            "tp_rank": mesh.tp_rank,
            "tp_size": mesh.tp_size,
            "tensors": tensors,
            "layouts": {n: encode_layout(v) for n, v in _layouts(module, tensors, mesh.tp_size).items()},
            "order": _stage_order(module, strategy.pipeline, names),
        }
        if optimizer_states is not None:
            piece["optimizers"] = [
                name_optimizer_state(state, _group_names(opt, names))
                for state, opt in zip(optimizer_states, strategy.optimizers, strict=True)
            ]
        write_file(piece, folder / piece_file(mesh.pp_rank, mesh.tp_rank))
        return [piece_file(mesh.pp_rank, mesh.tp_rank)]

    def finish(folder: Path, pieces: list[str]) -> list[str]:
        rest["lightning_parallel"] = {
            "format_version": FORMAT_VERSION,
            "layout": {"tensor_parallel": mesh.tp_size, "pipeline_parallel": mesh.pp_size,
                       "data_parallel": mesh.dp_size},
            "pieces": [META_FILE, *pieces],
        }
        write_file(rest, folder / META_FILE)
        return [META_FILE]

    save_pieces(path, write, finish, strategy.global_rank == 0)


# ---- read ------------------------------------------------------------------------------------
def checkpoint_to_read(path: Path, weights_only: Optional[bool] = None) -> Path:
    """``path``, or the checkpoint it was replacing when a save crashed between its two renames.

    Raises ``IncompleteCheckpointError`` for a directory whose save did not finish, naming its
    missing pieces. A directory written before completion markers existed is read when every piece
    of its layout is present.
    """

    def unconfirmed(folder: Path) -> tuple[dict[str, Optional[int]], bool]:
        try:
            info = torch.load(folder / META_FILE, map_location="cpu", weights_only=weights_only)["lightning_parallel"]
        except FileNotFoundError:
            return {META_FILE: None}, False
        except RuntimeError:  # a torn zip archive: its writer was stopped
            return {}, False
        if "pieces" in info:
            return dict.fromkeys(info["pieces"]), False
        pp, tp = info["layout"]["pipeline_parallel"], info["layout"]["tensor_parallel"]
        pieces = [piece_file(p, t) for p in range(pp) for t in range(tp)]
        return dict.fromkeys([META_FILE, *pieces]), True

    if path.is_dir() and not holds_checkpoint_files(path):
        return path
    return folder_to_read(path, unconfirmed)


def read_checkpoint(path: Path, weights_only: Optional[bool] = None) -> tuple[dict[str, Any], list[Piece]]:
    """The Lightning metadata and the pieces of a sharded directory or a plain checkpoint file.

    Shard files are memory-mapped, so a rank only reads the bytes of the tensors it needs.
    """
    path = checkpoint_to_read(path, weights_only)
    if is_sharded_checkpoint(path):
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
        pieces = []
        for file in sorted(path.glob("pp*-tp*.pt")):
            raw = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            pieces.append(Piece(
                tp_rank=raw["tp_rank"],
                tp_size=raw["tp_size"],
                tensors=raw["tensors"],
                layouts={n: decode_layout(v) for n, v in raw["layouts"].items()},
                optimizers=raw.get("optimizers", []),
                order=raw["order"],
            ))
        return meta, pieces
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: expected a sharded checkpoint directory or a .ckpt file")
    plain = torch.load(path, map_location="cpu", weights_only=weights_only)
    meta = {k: v for k, v in plain.items() if k not in ("state_dict", "optimizer_states")}
    tensors = plain["state_dict"]
    piece = Piece(0, 1, tensors, {n: (tuple(t.shape), None) for n, t in tensors.items()})
    piece.optimizers = plain.get("optimizer_states", [])  # by index; named in load_sharded
    return meta, [piece]


def _name_plain_optimizers(piece: Piece, local_names: list[list[list[str]]]) -> list[str]:
    """Key a plain checkpoint's optimizer states by name: by ``param_names`` when it has them,
    else by position, which holds only when this rank's groups have the saved sizes."""
    problems, named = [], []
    for i, state in enumerate(piece.optimizers):
        groups = state["param_groups"]
        if all("param_names" in g for g in groups):
            named.append(name_optimizer_state(state, [g["param_names"] for g in groups]))
            continue
        mine = local_names[i] if i < len(local_names) else []
        if [len(g["params"]) for g in groups] != [len(g) for g in mine]:
            problems.append(
                f"optimizer {i}: the checkpoint lists its parameters by position only (groups of "
                f"{[len(g['params']) for g in groups]}) and this rank holds groups of {[len(g) for g in mine]}; "
                "resume it on a layout without pipeline parallelism, or load the weights only"
            )
            continue
        named.append(name_optimizer_state(state, mine))
    piece.optimizers = named
    return problems


# ---- load ------------------------------------------------------------------------------------
def load_sharded(strategy: Any, filepath: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's checkpoint dict for this rank: ``state_dict`` and ``optimizer_states`` resharded
    onto the current layout, ready for the default ``load_model_state_dict``/``load_optimizer_state_dict``.

    Every name and shape is checked on every rank first; if any rank finds a problem, all ranks
    raise ``CheckpointMismatchError`` listing each parameter, and nothing is loaded.
    """
    path = checkpoint_to_read(Path(strategy.broadcast(str(filepath))), weights_only)
    mesh, module = strategy.mesh, strategy.lightning_module
    meta, pieces = read_checkpoint(path, weights_only)
    names = parameter_names(module, strategy.pipeline, mesh)
    local_names = [_group_names(opt, names) for opt in strategy.optimizers]
    plain_with_optimizers = not is_sharded_checkpoint(path) and strategy.optimizers
    problems = _name_plain_optimizers(pieces[0], local_names) if plain_with_optimizers else []

    local = module.state_dict(keep_vars=True)
    layouts = _layouts(module, local, mesh.tp_size)
    expected = {n: shape for n, (shape, _) in layouts.items()}
    problems += mismatches(expected, pieces, module.strict_loading)
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(expected))
    if module.strict_loading:
        problems += unexpected(saved_shapes(pieces), {n for names_of_rank in held for n in names_of_rank})
    problems += _optimizer_mismatches(pieces[0].optimizers, local_names)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank_problems in everyone for p in rank_problems})
    if found:
        raise CheckpointMismatchError(f"checkpoint {path} does not fit the model:\n  " + "\n  ".join(found))

    tp_rank, tp_size = mesh.tp_rank, mesh.tp_size
    saved = saved_shapes(pieces)
    state_dict = {
        n: local_tensor(full_tensor(n, pieces), layouts[n][1], tp_rank, tp_size) for n in local if n in saved
    }
    checkpoint = {**meta, "state_dict": state_dict}
    if strategy.optimizers and pieces[0].optimizers:
        by_name = {names[id(p)]: layouts[local_name] for local_name, p in module.named_parameters()}
        saved_layouts = {n: layout for p in pieces for n, layout in p.layouts.items()}
        checkpoint["optimizer_states"] = [
            _local_optimizer(i, pieces, group_names, by_name, saved_layouts, tp_rank, tp_size)
            for i, group_names in enumerate(local_names)
        ]
    return checkpoint


def _optimizer_mismatches(saved: list[dict[str, Any]], local_names: list[list[list[str]]]) -> list[str]:
    if not saved or not local_names:
        return []
    if len(saved) != len(local_names):
        return [f"the checkpoint has {len(saved)} optimizers, configure_optimizers returned {len(local_names)}"]
    return [
        f"optimizer {i}: the checkpoint has {len(s['param_groups'])} parameter groups, the model's optimizer {len(g)}"
        for i, (s, g) in enumerate(zip(saved, local_names, strict=True)) if len(s["param_groups"]) != len(g)
    ]


def _local_optimizer(index: int, pieces: list[Piece], group_names: list[list[str]], layouts: dict[str, Any],
                     saved_layouts: dict[str, Any], tp_rank: int, tp_size: int) -> dict[str, Any]:
    """Optimizer ``index``'s torch state dict for this rank, each state cut like its parameter."""
    state = {}
    for name in (n for group in group_names for n in group if n in saved_layouts):
        shape, shard = layouts[name]
        full = full_optimizer_state(name, index, pieces, saved_layouts[name])
        state[name] = local_optimizer_state(full, shape, shard, tp_rank, tp_size)
    return index_optimizer_state(pieces[0].optimizers[index], state, group_names)
