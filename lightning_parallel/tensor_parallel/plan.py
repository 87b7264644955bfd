"""Tensor-parallel plans: which module gets which style, found and checked before any sharding.

A plan maps module-name globs (``names.py``: ``*`` within one dotted segment, ``**`` across them,
matched against names relative to the module given to ``parallelize``) to a style:

``colwise``   ``nn.Linear`` (or HF ``Conv1D``) split by output features; options ``fused: n``
              (the output holds n equal blocks, e.g. 3 for a fused QKV, each split separately)
              and ``gather_output: true`` (all-gather the output, for a head whose logits the
              user's loss reads) and ``heads: n`` (the output holds n whole heads: a key or value
              projection; when the TP size is a multiple of n above it, each rank keeps a copy of
              the head its query heads attend to, ``kv_heads.py``; filled in for Hugging Face
              models from their config).
``rowwise``   ``nn.Linear`` (or HF ``Conv1D``) split by input features; its input must come from
              a colwise layer, or with ``split_input: true`` from a replicated activation (each
              rank keeps its slice); ``fused: n`` as for colwise, on the input features.
``vocab``     ``nn.Embedding`` split by vocabulary rows.
``attention`` a whole attention: ``nn.MultiheadAttention``, or nanoGPT-shaped attention (a fused
              ``Linear(d, 3d)``, a ``Linear(d, d)``, a head count ``n_head``/``num_heads`` or a
              ``head_dim``) whose forward is replaced by a TP-aware one.
``sequence_scatter``  with sequence parallelism only: the module's output is replicated and enters
              the sequence-parallel region (split along the sequence), e.g. a position embedding.
``replicated_grad_sum``  a module left whole whose input is split over the TP ranks (a per-head
              norm such as Qwen3's ``q_norm`` after a colwise ``q_proj``): each rank's gradient
              covers only its heads, so the gradients are summed over TP.
``moe_experts``  a Hugging Face experts module (3-D ``gate_up_proj`` / ``down_proj``, every
              expert in one parameter): every expert split Megatron style, the router left whole,
              one all-reduce of the combined expert output (``moe.py``); Llama-4's experts, which
              take the routed tokens only, get one all-reduce of their output as ``all_reduce``.
``moe_identity_expert``  an identity expert inside ``moe_experts``: its input is divided by the
              TP size, since the experts' output is summed over TP.
``mla_kv_a_proj``  the replicated ``kv_a_proj_with_mqa`` of multi-head latent attention: the
              rotary key part skips the colwise ``kv_b_proj`` and meets split heads, so its
              gradient is summed over TP.
``local_params``  a module whose own (not its submodules') parameters listed in ``params:
              {name: dim}`` are sliced along ``dim`` like the heads of its colwise projections
              (attention sinks, a per-head gate bias): each rank keeps its heads' entries, whose
              gradients are then complete, so they need no sum. Parameters it lacks (a layer
              without sinks) are skipped.
``all_reduce``  a module computing a partial sum from its own parameters sliced as in
              ``params:`` (a shared-expert block holding bare 3-D weights split colwise and
              rowwise): its tensor inputs pass through ``f`` (identity forward, all-reduce
              backward) and its output through ``g`` (all-reduce forward), Megatron's MLP split.

Any entry may add ``divide: [attr, ...]``: integer attributes (a stored head count) divided by
the TP size, for attention code that reshapes with them; an entry may consist of ``divide`` alone.

Plans come from the user (Hydra ``strategy.tp_plan``), from a Hugging Face model's own plan
(``_tp_plan`` / ``config.base_model_tp_plan``, relative to the HF model), from a built-in table
for HF models that carry none (GPT-2, whose ``Conv1D`` layers shard like Linears), or from
structure; ``detect.py`` finds them. Everything here is pure: no process group is touched, so every rank
reaches the same verdict and raises the same error before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from lightning_parallel.errors import IncompatibleModelError

STYLES = (
    "colwise",
    "rowwise",
    "vocab",
    "attention",
    "sequence_scatter",
    "replicated_grad_sum",
    "moe_experts",
    "moe_identity_expert",
    "mla_kv_a_proj",
    "local_params",
    "all_reduce",
)

# Hugging Face style names (transformers' ALL_PARALLEL_STYLES) that have an equivalent here.
HF_STYLES = {
    "colwise": {"style": "colwise"},
    "rowwise": {"style": "rowwise"},
    "colwise_gather_output": {"style": "colwise", "gather_output": True},
    "colwise_rep": {"style": "colwise", "gather_output": True},
    "packed_colwise": {"style": "colwise", "fused": 2},
    "packed_rowwise": {"style": "rowwise", "fused": 2},
    "rowwise_split_input": {"style": "rowwise", "split_input": True},
    "embedding_rowwise": {"style": "vocab"},
    "replicated_with_grad_allreduce": {"style": "replicated_grad_sum"},
    "moe_tp_experts": {"style": "moe_experts"},
    "moe_identity_expert": {"style": "moe_identity_expert"},
    "mla_kv_a_proj": {"style": "mla_kv_a_proj"},
    "local_params": {"style": "local_params"},
    "all_reduce": {"style": "all_reduce"},
}
# Styles whose plan may name the owner's bare parameters (``glob.param_name``) to be sliced.
PARAM_OWNER_STYLES = ("local_params", "all_reduce")
HF_IGNORED = ("replicate",)

# Plans for Hugging Face models that carry none, by ``config.model_type``, relative to the base
# model. GPT-2 stores its Linears as ``Conv1D`` (weight ``(in, out)``) and splits its fused QKV with
# a stored ``split_size``, which becomes the local width once divided by the TP size.
BUILTIN_HF_PLANS = {
    "gpt2": {
        "h.*.attn": {"divide": ["split_size", "num_heads"]},
        "h.*.attn.c_attn": {"style": "colwise", "fused": 3},
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    "openai-gpt": {  # GPT-1: GPT-2's layout, head count stored as n_head
        "h.*.attn": {"divide": ["split_size", "n_head"]},
        "h.*.attn.c_attn": {"style": "colwise", "fused": 3},
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
}

# Where a Hugging Face model's own plan gathers a layer's output (``colwise_gather_output``) and
# splits it again for the next (``rowwise_split_input``) but the model's code allows Megatron's
# pairing, by ``config.model_type``, relative to the base model. These MLPs split their fused
# ``gate_up_proj`` with ``chunk(2)``, so each half is split on its own and ``down_proj`` takes the
# split activation: one all-reduce each way instead of an all-gather and an all-reduce. (Their
# attention slices a fused QKV at absolute offsets read from the shared config, so it keeps the
# gather.)
_PAIRED_GATE_UP = {"layers.*.mlp.gate_up_proj": {"style": "colwise", "fused": 2}, "layers.*.mlp.down_proj": "rowwise"}
HF_PAIRED_LAYERS = {"phi3": _PAIRED_GATE_UP, "glm": _PAIRED_GATE_UP, "glm4": _PAIRED_GATE_UP}


class TensorParallelError(IncompatibleModelError):
    """A model or plan that cannot be tensor-parallelised as asked; says what would work."""


@dataclass(frozen=True)
class PlanEntry:
    """The style for the modules one glob matches."""

    style: Optional[str] = None
    fused: int = 1
    gather_output: bool = False
    divide: tuple[str, ...] = ()
    split_input: bool = False
    params: tuple[tuple[str, int], ...] = ()  # (own parameter, dim it is split along)
    heads: int = 0  # colwise: whole heads in the output (0: not stated); copied when TP exceeds them

    def copies(self, tp: int) -> int:
        """How many TP ranks hold each slice: ``tp / heads`` for a colwise layer over fewer heads than
        TP ranks, else 1."""
        return tp // self.heads if self.heads and tp > self.heads else 1

    def describe(self) -> str:
        parts = [self.style or "attributes"]
        if self.fused > 1:
            parts.append(f"fused={self.fused}")
        if self.gather_output:
            parts.append("gather_output")
        if self.split_input:
            parts.append("split_input")
        if self.divide:
            parts.append("divide " + ",".join(self.divide))
        if self.params:
            parts.append("params " + ",".join(f"{n}:{d}" for n, d in self.params))
        if self.heads:
            parts.append(f"heads={self.heads}")
        return " ".join(parts)


Plan = dict[str, PlanEntry]


def parse_plan(raw: Mapping) -> Plan:
    """A plan from plain data: ``{glob: style}`` or
    ``{glob: {style:, fused:, gather_output:, split_input:, divide:, params:, heads:}}``."""
    plan: Plan = {}
    for glob, value in raw.items():
        if isinstance(value, str):
            value = {"style": value}
        if not isinstance(value, Mapping):
            raise TensorParallelError(f"tp_plan[{glob!r}] must be a style name or a mapping, got {value!r}")
        unknown = set(value) - {"style", "fused", "gather_output", "split_input", "divide", "params", "heads"}
        if unknown:
            raise TensorParallelError(
                f"tp_plan[{glob!r}] has unknown keys {sorted(unknown)}; "
                "allowed: style, fused, gather_output, split_input, divide, params, heads"
            )
        style = value.get("style")
        if style is not None and style not in STYLES:
            raise TensorParallelError(f"tp_plan[{glob!r}]: unknown style {style!r}; known styles: {', '.join(STYLES)}")
        if style is None and not value.get("divide"):
            raise TensorParallelError(f"tp_plan[{glob!r}] needs a style or a divide list")
        fused = int(value.get("fused", 1))
        if fused < 1 or (fused > 1 and style not in ("colwise", "rowwise")):
            raise TensorParallelError(f"tp_plan[{glob!r}]: fused={fused} needs style colwise or rowwise and fused >= 1")
        split_input = bool(value.get("split_input", False))
        if split_input and style != "rowwise":
            raise TensorParallelError(f"tp_plan[{glob!r}]: split_input needs style rowwise")
        params = value.get("params", {})
        if params and style not in PARAM_OWNER_STYLES or not isinstance(params, Mapping):
            raise TensorParallelError(
                f"tp_plan[{glob!r}]: params must be a mapping {{parameter: dim}} and needs style "
                f"{' or '.join(PARAM_OWNER_STYLES)}"
            )
        heads = value.get("heads", 0)
        if heads and (style != "colwise" or fused > 1 or value.get("gather_output") or not isinstance(heads, int)
                      or heads < 1):
            raise TensorParallelError(
                f"tp_plan[{glob!r}]: heads={heads!r} needs style colwise without fused or gather_output, "
                "and a positive number of heads"
            )
        plan[str(glob)] = PlanEntry(
            style,
            fused,
            bool(value.get("gather_output", False)),
            tuple(value.get("divide", ())),
            split_input,
            tuple((str(n), int(d)) for n, d in params.items()),
            heads,
        )
    return plan
