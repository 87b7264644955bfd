"""Save and load sharded checkpoints from a ``ParallelStrategy`` (every rank calls these).

A checkpoint path becomes a directory: ``meta.pt`` holds what Lightning saves besides weights
(epoch, global step, loops, callbacks, LR schedulers, hyper-parameters, the optimizers' parameter
groups) and the layout it was written on; the tensors, optimizer states and, with weight averaging,
the module's weights beside their average and SWA's average (``module_states.py``) are in PyTorch
Distributed Checkpoint format under their global names (``dcp.py``): every rank writes its own
file in parallel, and on loading reads only the chunks its current layout needs, so a run may
resume on a different number of processes or a different split. Two older inputs still load: a
directory of ``pp{p}-tp{t}.pt`` pieces (read whole and resharded by ``format.py``), and a plain
``.ckpt`` file (one device, or ``lp-consolidate``'s output), read as a single piece.

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
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_parallel.checkpoint import dcp, module_states
from lightning_parallel.checkpoint.atomic import (
    MARKER,
    folder_to_read,
    save_pieces,
    write_file,
)
from lightning_parallel.checkpoint.background import BackgroundSaves
from lightning_parallel.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointMismatchError,
    Piece,
    decode_layout,
    full_optimizer_state,
    full_tensor,
    global_shape,
    index_optimizer_state,
    layout_of,
    local_optimizer_state,
    local_tensor,
    mismatches,
    name_optimizer_state,
    saved_shapes,
    shape_mismatches,
    unexpected,
)
from lightning_parallel.data_parallel.fully_sharded import (
    local_slice,
    rows_of,
    sharded_like,
)
from lightning_parallel.data_parallel.zero import configured_param_groups

META_FILE = "meta.pt"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def holds_checkpoint_files(path: Path) -> bool:
    """Whether directory ``path`` holds any file of a sharded checkpoint, complete or not."""
    return (any((path / name).is_file() for name in (META_FILE, MARKER, dcp.METADATA))
            or any(path.glob("pp*-tp*.pt")) or any(path.glob("*.distcp")))


def piece_file(pp_rank: int, tp_rank: int) -> str:
    """The file of pipeline rank p and TP rank t in the format before DCP."""
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
        shard = layout_of(params.get(name))
        layouts[name] = (global_shape(t.shape, shard, tp_size), shard)
    return layouts


def _group_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    # as configured: under ZeRO-1 the optimizer steps on slices, its state is saved by parameter
    return [[names[id(p)] for p in group] for group in configured_param_groups(optimizer)]


# ---- save ------------------------------------------------------------------------------------
def save_sharded(strategy: Any, checkpoint: dict[str, Any], filepath: Any,
                 background: Optional[BackgroundSaves] = None) -> None:
    """Write ``checkpoint`` (Lightning's dict, from this rank) as a sharded checkpoint directory.

    It replaces an existing checkpoint only once every piece is written (``atomic.save_pieces``); if
    any rank fails, every rank raises ``CheckpointSaveError`` and the previous checkpoint stays.
    With ``background``, the tensors are staged in host memory and the write runs on its thread
    (``background.py``): this returns once they are staged, and the error of a failed write is
    raised by the next save, load or teardown.
    """
    path = Path(strategy.broadcast(str(filepath)))
    mesh, module = strategy.mesh, strategy.lightning_module
    foreign = path.is_dir() and not holds_checkpoint_files(path) and any(path.iterdir())
    if strategy.broadcast(foreign):  # rank 0's view, so that every rank raises
        raise IsADirectoryError(f"the checkpoint path {path} is a directory that is not a checkpoint; choose another")
    names = parameter_names(module, strategy.pipeline, mesh)
    rest = dict(checkpoint)
    tensors = rest.pop("state_dict")
    places = module_states.places(rest)  # with weight averaging: the module's weights, SWA's average
    extra = [module_states.at(rest, place) for place in places]
    for place in places:
        rest = module_states.replaced(rest, place, None)
    optimizer_states = rest.pop("optimizer_states", None)
    named = [] if optimizer_states is None else [
        name_optimizer_state(state, _group_names(opt, names))
        for state, opt in zip(optimizer_states, strategy.optimizers, strict=True)
    ]
    layouts = _layouts(module, tensors, mesh.tp_size)
    param_layouts = _parameter_layouts(module, names, layouts)
    for k, state in enumerate(extra):  # split like the model, under their own keys
        prefix = dcp.module_state_prefix(k)
        layouts = {**layouts, **{prefix + n: v for n, v in _layouts(module, state, mesh.tp_size).items()}}
        tensors = {**tensors, **{prefix + n: t for n, t in state.items()}}
    slices = _zero_slices(strategy, names)
    if slices:  # ZeRO-1: each rank holds its own slices (``ZeroOneSharding.local_state_dict``)
        for name in _slices_written_elsewhere(strategy, names, param_layouts):
            for n in named:
                n["state"].pop(name, None)
    chunked, objects = dcp.chunked_state(tensors, layouts, named, param_layouts, mesh.tp_rank, mesh.tp_size, slices)
    objects[dcp.piece_key(mesh.pp_rank, mesh.tp_rank)] = {
        "order": _stage_order(module, strategy.pipeline, names),
        "groups": [[group["params"] for group in n["param_groups"]] for n in named],
    }
    # hyper-parameters of each group; the state is in the DCP files, by parameter name
    optimizers = [{"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in n["param_groups"]]}
                  for n in named]
    group = None
    if background is not None:  # what is written from now on are copies: training may go on
        chunked, objects, rest, optimizers = background.stage((chunked, objects, rest, optimizers))
        group = background.group

    def finish(folder: Path, pieces: list[str]) -> list[str]:
        rest["lightning_parallel"] = {
            "format_version": FORMAT_VERSION,
            "layout": {"tensor_parallel": mesh.tp_size, "pipeline_parallel": mesh.pp_size,
                       "data_parallel": mesh.dp_size},
            "pieces": [META_FILE, *pieces],
            "module_states": places,
            "optimizers": optimizers,
        }
        write_file(rest, folder / META_FILE)
        return [META_FILE]

    def save() -> None:
        save_pieces(path, lambda folder: dcp.save_chunks(folder, chunked, objects, group), finish,
                    strategy.global_rank == 0, group)

    if background is not None:
        background.submit(save)
    else:
        save()


def _zero_slices(strategy: Any, names: dict[int, str]) -> dict[str, tuple[int, int]]:
    """Under ZeRO, ``name -> (begin, length)`` of this rank's slice of every sharded parameter (of its
    flattened TP shard): ZeRO-1's slices of the optimizer state, ZeRO-2/3's rows of the parameter."""
    if strategy.zero is not None:
        return {names[id(p)]: where for p, where in strategy.zero.slices().items()}
    return {names[id(p)]: local_slice(p) for p in strategy.lightning_module.parameters() if isinstance(p, DTensor)}


def _slices_written_elsewhere(strategy: Any, names: dict[int, str], param_layouts: dict[str, Any]) -> set[str]:
    """Parameters whose optimizer slices another rank writes: a weight shared by pipeline stages is
    written by its first stage, a weight replicated over TP ranks by TP rank 0. Their other holders
    may cut them into other slices (other buckets), and DCP needs the saved chunks not to overlap."""
    mesh = strategy.mesh
    tied = strategy.pipeline.tied if strategy.pipeline is not None else []
    skipped = {names[id(p)] for p, _, ranks in tied if mesh.pp_rank != min(ranks)}
    if mesh.tp_rank > 0:
        skipped |= {name for name, (_, shard) in param_layouts.items() if shard is None}
    return skipped


def _parameter_layouts(module: nn.Module, names: dict[int, str], layouts: dict[str, Any]) -> dict[str, Any]:
    """Layout of every local parameter by the name its optimizer state goes by."""
    return {names[id(p)]: layouts[local_name] for local_name, p in module.named_parameters()}


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


def read_checkpoint(path: Path, weights_only: Optional[bool] = None,
                    mmap: bool = False) -> tuple[dict[str, Any], list[Piece]]:
    """The Lightning metadata and the pieces of a directory in the format before DCP, or of a plain
    checkpoint file.

    Shard files are memory-mapped, so a rank only reads the bytes of the tensors it needs; a plain
    file too with ``mmap``.
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
    plain = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
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
def load_sharded(strategy: Any, filepath: Any, weights_only: Optional[bool] = None,
                 strict: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's checkpoint dict for this rank: ``state_dict`` and ``optimizer_states`` resharded
    onto the current layout, ready for the default ``load_model_state_dict``/``load_optimizer_state_dict``;
    so are the module-shaped state dicts of weight averaging (``module_states.py``), which its callbacks
    load themselves.

    Every name and shape is checked on every rank first; if any rank finds a problem, all ranks
    raise ``CheckpointMismatchError`` listing each parameter, and nothing is loaded. ``strict``: whether
    every tensor must match; None: the LightningModule's ``strict_loading`` (True for a plain module).
    """
    path = checkpoint_to_read(Path(strategy.broadcast(str(filepath))), weights_only)
    mesh, module, device = strategy.mesh, strategy.lightning_module, strategy.root_device
    strict = getattr(module, "strict_loading", True) if strict is None else strict
    names = parameter_names(module, strategy.pipeline, mesh)
    local_names = [_group_names(opt, names) for opt in strategy.optimizers]
    local = module.state_dict(keep_vars=True)
    layouts = _layouts(module, local, mesh.tp_size)
    expected = {n: shape for n, (shape, _) in layouts.items()}

    if dcp.is_dcp_checkpoint(path):
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
        metadata = dcp.read_metadata(path)
        saved = dcp.tensor_shapes(metadata)
        saved_optimizers = meta["lightning_parallel"]["optimizers"]
        problems = shape_mismatches(expected, saved, strict)
        problems += dcp.incomplete_tensors(metadata, [n for n in expected if n in saved])
        places = meta["lightning_parallel"].get("module_states", [])
        sections = [(dcp.module_state_prefix(k), [n for n in local if n in dcp.tensor_shapes(
            metadata, dcp.module_state_prefix(k))]) for k in range(len(places))]
        problems += dcp.incomplete_tensors(metadata, [prefix + n for prefix, names in sections for n in names])
    else:
        meta, pieces = read_checkpoint(path, weights_only)
        plain_with_optimizers = not is_sharded_checkpoint(path) and strategy.optimizers
        problems = _name_plain_optimizers(pieces[0], local_names) if plain_with_optimizers else []
        saved, saved_optimizers = saved_shapes(pieces), pieces[0].optimizers
        problems += mismatches(expected, pieces, strict)
    if strict:
        problems += unexpected(saved, _held_anywhere(list(saved), set(expected), device))
    problems += _optimizer_mismatches(saved_optimizers, local_names)
    _agree_on_problems(problems, path, device)

    tp_rank, tp_size = mesh.tp_rank, mesh.tp_size
    param_layouts = _parameter_layouts(module, names, layouts)
    with_optimizers = bool(strategy.optimizers and saved_optimizers)
    # ZeRO-2/3: what is sharded over the data-parallel replicas, by state-dict name and by parameter name
    rows = {n: t for n, t in local.items() if isinstance(t, DTensor)}
    rows.update((names[id(p)], p) for p in module.parameters() if isinstance(p, DTensor))
    if dcp.is_dcp_checkpoint(path):
        (state_dict, *extra), optimizer_states = _read_dcp(
            path, metadata, strategy, [("", [n for n in local if n in saved]), *sections], layouts, param_layouts,
            local_names if with_optimizers else [], saved_optimizers, _zero_slices(strategy, names), rows)
        for place, state in zip(places, extra):
            meta = module_states.replaced(meta, place, state)
    else:
        state_dict = _local_state(pieces, local, layouts, rows, tp_rank, tp_size)
        for place in module_states.places(meta):  # a plain file's whole modules, by weight averaging
            tensors = module_states.at(meta, place)
            whole = Piece(0, 1, tensors, {n: (tuple(t.shape), None) for n, t in tensors.items()})
            meta = module_states.replaced(meta, place, _local_state([whole], local, layouts, rows, tp_rank, tp_size))
        saved_layouts = {n: layout for p in pieces for n, layout in p.layouts.items()}
        optimizer_states = [
            _local_optimizer(i, pieces, group_names, param_layouts, saved_layouts, tp_rank, tp_size, rows)
            for i, group_names in enumerate(local_names if with_optimizers else [])
        ]
    checkpoint = {**meta, "state_dict": state_dict}
    if with_optimizers:
        checkpoint["optimizer_states"] = optimizer_states
    return checkpoint


def _local_state(pieces: list[Piece], local: dict[str, torch.Tensor], layouts: dict[str, Any],
                 rows: dict[str, DTensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This rank's part of the state dict whose whole tensors ``pieces`` hold, cut like ``local``'s."""
    saved = saved_shapes(pieces)
    state = {n: local_tensor(full_tensor(n, pieces), layouts[n][1], tp_rank, tp_size) for n in local if n in saved}
    return {n: sharded_like(t, rows[n]) if n in rows else t for n, t in state.items()}


def _held_anywhere(saved: list[str], mine: set[str], device: torch.device) -> set[str]:
    """The ``saved`` names that some rank holds: one flag per name, reduced over the world (every rank
    lists ``saved`` in the same order, so no name is sent)."""
    flags = torch.tensor([name in mine for name in saved], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {name for name, held in zip(saved, flags.tolist()) if held}


def _agree_on_problems(problems: list[str], path: Path, device: torch.device) -> None:
    """Raise ``CheckpointMismatchError`` on every rank if any rank found a problem, listing them all.

    A count is reduced first; the messages travel only when there are some.
    """
    count = torch.tensor([len(problems)], device=device)
    dist.all_reduce(count)
    if not count.item():
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank_problems in everyone for p in rank_problems})
    raise CheckpointMismatchError(f"checkpoint {path} does not fit the model:\n  " + "\n  ".join(found))


def _read_dcp(path: Path, metadata: Any, strategy: Any, sections: list[tuple[str, list[str]]],
              layouts: dict[str, Any], param_layouts: dict[str, Any], local_names: list[list[list[str]]],
              saved_optimizers: list[dict[str, Any]], slices: dict[str, tuple[int, int]], rows: dict[str, DTensor]
              ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """This rank's part of each module-shaped state dict (``sections``: its DCP prefix, "" for
    ``state_dict``, and the names to read) and the torch state dict of each optimizer, read from the
    chunks it needs.

    Under ZeRO-1 a parameter in ``slices`` gets only this rank's slice of its parameter-shaped
    states, read by this rank alone; under ZeRO-2/3 a tensor or parameter in ``rows`` (by name: the
    DTensor it is sharded like) likewise its rows, itself and its states. Everything else its
    data-parallel replicas need too, so they share the reads."""
    mesh = strategy.mesh
    tp_rank, tp_size = mesh.tp_rank, mesh.tp_size
    own: dcp.ChunkedTensors = {}  # ZeRO slices
    targets = {}
    for prefix, names in sections:
        for n in names:
            if n in rows:
                own[prefix + n] = dcp.slice_target(metadata, prefix + n, layouts[n], tp_rank, tp_size,
                                                   *local_slice(rows[n]))
            else:
                targets[prefix + n] = dcp.local_target(metadata, prefix + n, layouts[n], tp_rank, tp_size)
    state_dicts = [{n: (own if n in rows else targets)[prefix + n][0] for n in names} for prefix, names in sections]
    entries = dcp.optimizer_entries(metadata)
    states: list[dict[str, dict[str, Any]]] = []
    objects: list[tuple[dict[str, Any], str, str]] = []  # (state, key, DCP key) of non-tensor values
    sharded: list[tuple[dict[str, Any], str, DTensor]] = []  # (state, key, like) of ZeRO-2/3 rows
    for index, group_names in enumerate(local_names):
        state: dict[str, dict[str, Any]] = {}
        for name in (n for group in group_names for n in group):
            for key, fqn in entries.get((index, name), {}).items():
                entry = state.setdefault(name, {})
                md = metadata.state_dict_metadata[fqn]
                if isinstance(md, BytesStorageMetadata):
                    objects.append((entry, key, fqn))
                elif name in slices and tuple(md.size) == tuple(param_layouts[name][0]):
                    own[fqn] = dcp.slice_target(metadata, fqn, param_layouts[name], tp_rank, tp_size, *slices[name])
                    entry[key] = own[fqn][0]
                    if name in rows:
                        sharded.append((entry, key, rows[name]))
                else:
                    targets[fqn] = dcp.local_target(metadata, fqn, param_layouts[name], tp_rank, tp_size)
                    entry[key] = targets[fqn][0]
        states.append(state)
    # replicas that need the same chunks share the reads: with expert parallelism, those holding the same experts
    group = (mesh.dp_group if mesh.ep_size == 1 else mesh.edp_group) if mesh.dp_size // mesh.ep_size > 1 else None
    values = dcp.read_chunks(path, metadata, targets, [fqn for _, _, fqn in objects], group, strategy.root_device)
    dcp.read_chunks(path, metadata, own, [])
    for entry, key, fqn in objects:
        entry[key] = values[fqn]
    for tensors in state_dicts:
        tensors.update((n, rows_of(t, rows[n])) for n, t in tensors.items() if n in rows)
    for entry, key, like in sharded:
        entry[key] = rows_of(entry[key], like)
    optimizer_states = [index_optimizer_state(saved_optimizers[i], state, local_names[i])
                        for i, state in enumerate(states)]
    return state_dicts, optimizer_states


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
                     saved_layouts: dict[str, Any], tp_rank: int, tp_size: int,
                     rows: dict[str, DTensor]) -> dict[str, Any]:
    """Optimizer ``index``'s torch state dict for this rank, each state cut like its parameter (also over
    the data-parallel replicas where ``rows`` gives the parameter sharded so)."""
    state = {}
    for name in (n for group in group_names for n in group if n in saved_layouts):
        shape, shard = layouts[name]
        full = full_optimizer_state(name, index, pieces, saved_layouts[name])
        state[name] = local_optimizer_state(full, shape, shard, tp_rank, tp_size)
        if name in rows:
            like = rows[name]
            state[name] = {key: sharded_like(v, like) if isinstance(v, torch.Tensor) and v.shape == like.shape else v
                           for key, v in state[name].items()}
    return index_optimizer_state(pieces[0].optimizers[index], state, group_names)
