"""What one sample asks of each part of a model, read from the model itself: the planner's costs.

The layout search needs, per repeated block (``pipeline.partition.find_blocks``), the forward FLOPs and
the bytes autograd keeps for the backward, and, outside the blocks, the same for the modules before
them (embeddings) and after them (final norm, head, loss); plus the size of the hidden state that
crosses a stage boundary and that tensor parallelism all-reduces. ``traced_profile`` measures them in
one run of the module's own step on its first batch (on the meta device when the model lives there,
so a 7B model costs no memory):

* FLOPs from ``torch.utils.flop_counter.FlopCounterMode``, read at each block's entry and exit;
* activation bytes from ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for the
  backward, each storage once, parameters left out, counted to the part of the model that ran.

A block's saved tensors as wide as the hidden state (normalisation inputs, the inputs of the first
projections, residuals) are held whole by every TP rank, the others (heads' queries, keys, scores,
the MLP's inner activations) are divided by the TP size, and sequence parallelism divides both: the
split of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, §4), read from tensor shapes instead of a formula.

Where the module names its sizes (a Hugging Face config, nanoGPT's ``n_embd``, ``n_head``,
``vocab_size``), ``named_profile`` gives the same quantities from the formulas of ``estimate.py`` and
``cost.py`` without running anything: a shortcut, taken when no batch is at hand. A model that neither
names its sizes nor can be traced gets ``parameter_profile``: two FLOPs per parameter and token, no
activations, which still ranks data-parallel layouts (the only ones such a model splits into).
"""

from __future__ import annotations

from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.pipeline.errors import PipelineConfigError, PipelineIncompatibleModel
from lightning_parallel.pipeline.partition import find_blocks, outer_modules
from lightning_parallel.planner.batch import batch_shape
from lightning_parallel.planner.estimate import TransformerDims, transformer_dims
from lightning_parallel.tensor_parallel.resolve import is_conv1d


@dataclass(frozen=True)
class BlockProfile:
    """One block, for one sample: forward FLOPs and the bytes it saves for backward."""

    params: int
    flops: float
    kept_bytes: float  # saved tensors as wide as the hidden state: whole on every TP rank (without SP)
    split_bytes: float  # the others: divided by the TP size

    def saved_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return self.kept_bytes / (tp if sequence_parallel else 1) + self.split_bytes / tp


@dataclass(frozen=True)
class ModelProfile:
    """A model's costs per sample (``seq`` tokens), in the element size ``element_bytes`` it was read at.

    ``source``: ``"traced"`` (one run of the step), ``"named"`` (the module's named sizes) or
    ``"parameters"`` (neither could be read). ``hidden``: elements per token of the hidden state
    between blocks; ``kv_hidden`` the keys' (context parallelism's ring); ``vocab`` the embedding's rows
    (0 where there is none: no vocabulary-parallel reductions).
    """

    source: str
    seq: int
    blocks: tuple[BlockProfile, ...]
    pre_flops: float
    post_flops: float
    pre_bytes: float
    post_bytes: float  # the head and loss (logits in float32 and their gradient); divided by TP where it shards them
    hidden: int
    kv_hidden: int
    vocab: int
    element_bytes: int = 4
    heads: Optional[int] = None

    @property
    def boundary(self) -> float:
        """Elements of one sample's hidden state between two blocks."""
        return self.seq * self.hidden

    def block_flops(self, indices) -> float:
        return sum(self.blocks[i].flops for i in indices)

    def scale(self, act_bytes: int) -> float:
        """Factor from the bytes read here to activations of ``act_bytes`` per element."""
        return act_bytes / self.element_bytes

    def describe(self) -> str:
        per_block = sum(b.flops for b in self.blocks) / max(1, len(self.blocks))
        saved = sum(b.kept_bytes + b.split_bytes for b in self.blocks) / max(1, len(self.blocks))
        how = {"traced": "measured in one traced step", "named": "from the model's named sizes",
               "parameters": "from the parameter count alone"}[self.source]
        return (f"{len(self.blocks)} blocks of {per_block / 1e6:.3g} MFLOP and {saved / 2**20:.3g} MiB saved per "
                f"sample, hidden state {self.hidden} per token x {self.seq} ({how}, planner/profile.py)")


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) or is_conv1d(m))


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _blocks(model: nn.Module, path: Optional[str]) -> tuple[str, nn.Module]:
    try:
        return find_blocks(model, path)
    except (PipelineConfigError, PipelineIncompatibleModel):
        return "", nn.ModuleList()


def named_profile(model: nn.Module, dims: TransformerDims, seq: int, blocks_path: Optional[str] = None) -> ModelProfile:
    """The profile of a GPT-style transformer from its named sizes: ``2`` FLOPs per weight and token of
    every linear layer plus ``4 s h`` per token and layer for attention (Narayanan et al. 2021, arXiv
    2104.04473 §5.1), and Korthikanti et al.'s activations per layer (``estimate.layer_activation_bytes``,
    at 4 bytes an element); the logits and their gradient in float32 (``8 s V``) on the last stage."""
    path, blocks = _blocks(model, blocks_path)
    s, h, a = seq, dims.hidden, dims.heads
    pre, post = outer_modules(model, path) if path else ([], [])
    per_block = [BlockProfile(_params(b), s * (2 * _linear_weights(b) + 4 * s * h),
                              2 * 10 * s * h, 2 * (24 * s * h + 5 * a * s * s)) for b in blocks]
    return ModelProfile("named", seq, tuple(per_block),
                        s * sum(2 * _linear_weights(model.get_submodule(n)) for n in pre),
                        s * sum(2 * _linear_weights(model.get_submodule(n)) for n in post),
                        0.0, 8.0 * s * dims.vocab, h, dims.kv_hidden, dims.vocab, 4, dims.heads)


def parameter_profile(model: nn.Module, seq: int, blocks_path: Optional[str] = None) -> ModelProfile:
    """Two FLOPs per parameter and token, nothing saved: what a model that shows nothing else gets."""
    path, blocks = _blocks(model, blocks_path)
    inside = sum(_params(b) for b in blocks)
    per_block = tuple(BlockProfile(_params(b), 2.0 * seq * _params(b), 0.0, 0.0) for b in blocks)
    return ModelProfile("parameters", seq, per_block, 2.0 * seq * (_params(model) - inside), 0.0, 0.0, 0.0,
                        1, 1, 0)


@contextmanager
def _meta_parameters(model: nn.Module) -> Iterator[None]:
    """Inside, ``model``'s parameters are meta tensors of their shapes (tied ones still tied); on exit the
    original parameters are back in place. The trace then computes nothing and allocates nothing."""
    swapped: list[tuple[dict, str, nn.Parameter]] = []
    stand_ins: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not p.is_meta:
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                swapped.append((m._parameters, name, p))
                m._parameters[name] = stand_ins[id(p)]
    try:
        yield
    finally:
        for table, name, p in swapped:
            table[name] = p


class _Regions:
    """FLOPs and saved bytes of the part of the model that runs: before the blocks, block ``i``, after them."""

    def __init__(self, n_blocks: int, counter: FlopCounterMode, skip: set[int]):
        self.n, self.counter, self.skip = n_blocks, counter, skip
        self.current: Any = "pre"
        self.entered_at = 0
        self.flops: dict[Any, float] = {}
        self.kept: dict[Any, float] = {}
        self.split: dict[Any, float] = {}
        self.largest_post = 0.0
        self.seen: set[int] = set()
        self.alive: list = []
        self.width: Optional[int] = None  # last dimension of the hidden state
        self.first: Optional[tuple[int, int]] = None  # elements and bytes per element of the first block's input

    def close(self) -> None:
        total = self.counter.get_total_flops()
        self.flops[self.current] = self.flops.get(self.current, 0.0) + total - self.entered_at
        self.entered_at = total

    def enter(self, index: int):
        def hook(_module, args, kwargs):
            self.close()
            self.current = index
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and self.first is None:  # sizes only: no reference into the graph
                self.first, self.width = (x.numel(), x.element_size()), x.shape[-1]
        return hook

    def leave(self, index: int):
        def hook(_module, _args, _kwargs, _out):
            self.close()
            self.current = "post" if index == self.n - 1 else "between"
        return hook

    def pack(self, t: torch.Tensor) -> None:
        """Counts ``t`` and keeps nothing: the trace never runs backward, and a saved output holding
        its own graph would be a reference cycle keeping the parameters alive."""
        key = StorageWeakRef(t.untyped_storage()).cdata
        if key in self.skip or key in self.seen:
            return None
        self.seen.add(key)
        self.alive.append(t.untyped_storage())  # so that no later storage takes its address (no graph held)
        nbytes = float(t.untyped_storage().nbytes())
        region = self.current
        if region == "post":
            self.largest_post = max(self.largest_post, nbytes)
        table = self.kept if isinstance(region, str) or (t.dim() and t.shape[-1] == self.width) else self.split
        table[region] = table.get(region, 0.0) + nbytes
        return None


def _no_backward(_packed: None) -> torch.Tensor:
    raise RuntimeError("the profiling trace runs no backward")


def traced_profile(model: nn.Module, example: Any, step: Optional[Callable[[Any], Any]] = None,
                   blocks_path: Optional[str] = None) -> ModelProfile:
    """The profile measured in one run of ``step`` (default: the module's ``training_step(batch, 0)``) on
    ``example``, divided by its samples (see the module docstring). On the meta device whatever device the
    model is on: nothing is computed or allocated. Raises what the step raises (data-dependent code,
    ``.item()``, cannot run on meta tensors); the model is left as it was."""
    from lightning_parallel.pipeline.isolation import untouched
    from lightning_parallel.pipeline.meta_trace import meta_batch, meta_device
    from lightning_parallel.pipeline.order import traced_conditions

    shape = batch_shape(example)
    if shape is None:
        raise ValueError("the example batch holds no tensor")
    samples, seq = shape
    path, blocks = _blocks(model, blocks_path)
    step = step or (lambda batch: model.training_step(batch, 0))
    counter = FlopCounterMode(display=False)
    handles, own_log = [], model.__dict__.get("log")
    try:
        model.log = lambda *args, **kwargs: None  # the trace is no training step: it logs nothing
        with _meta_parameters(model), untouched(model), meta_device(model), traced_conditions(model):
            skip = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
            regions = _Regions(len(blocks), counter, skip)
            for i, b in enumerate(blocks):
                handles += [b.register_forward_pre_hook(regions.enter(i), with_kwargs=True),
                            b.register_forward_hook(regions.leave(i), with_kwargs=True)]
            with counter, torch.autograd.graph.saved_tensors_hooks(regions.pack, _no_backward):
                step(meta_batch(example))
                regions.close()
    finally:
        for h in handles:
            h.remove()
        del model.log
        if own_log is not None:
            model.log = own_log
    numel, element = regions.first or (samples * seq, 4)
    hidden = max(1, numel // (samples * seq))
    per_block = tuple(BlockProfile(_params(b), regions.flops.get(i, 0.0) / samples, regions.kept.get(i, 0.0) / samples,
                                   regions.split.get(i, 0.0) / samples) for i, b in enumerate(blocks))
    outer = ("pre", "between")
    # after the blocks: what the head and loss save, and the gradient of the largest of them (the logits)
    post_bytes = (regions.kept.get("post", 0.0) + regions.largest_post) / samples
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    heads = next((m.num_heads for m in model.modules() if isinstance(m, nn.MultiheadAttention)), None)
    return ModelProfile("traced", seq, per_block, sum(regions.flops.get(r, 0.0) for r in outer) / samples,
                        regions.flops.get("post", 0.0) / samples,
                        sum(regions.kept.get(r, 0.0) for r in outer) / samples, post_bytes,
                        hidden, hidden, embeddings[0].num_embeddings if embeddings else 0, element, heads)


def model_profile(model: nn.Module, seq: int, example: Any = None, blocks_path: Optional[str] = None) -> ModelProfile:
    """The model's profile: from its named sizes where it has them, else traced on ``example`` (its first
    batch), else from its parameters alone (where no batch is given or the step cannot be traced)."""
    dims = transformer_dims(model)
    if dims is not None:
        return named_profile(model, dims, seq, blocks_path)
    if example is not None:
        try:
            return traced_profile(model, example, blocks_path=blocks_path)
        except Exception:  # noqa: BLE001 - any failure of the user's step on meta tensors: fall back
            pass
    return parameter_profile(model, seq, blocks_path)


def matmul_width(profile: ModelProfile) -> int:
    """The hidden size the calibration times its matmul at (``calibrate.matmul_rate``), within 64 to 8192."""
    return min(8192, max(64, int(profile.hidden)))
