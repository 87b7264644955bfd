"""Every causal-LM architecture of the installed ``transformers``, as a tiny LightningModule.

One generic recipe, no per-model tuning and no download: instantiate the architecture's config
class with no arguments, then set whichever of the size fields of a ``Shape`` it has (under its own
name or through ``attribute_map``; ``tiny_fields``): hidden size, heads and KV heads, head size,
layers, vocabulary, tied or untied head, experts, dropouts 0, no cache, small MLA sizes. The zoo
runs at several shapes (``SHAPES``), since what a split gets wrong can depend on head ratios, head
size, vocabulary padding or an uneven pipeline split. Architectures whose config ignores or
contradicts these sizes fail to build or train here, which says nothing about parallelism; the zoo
only keeps the ones that train on one process.

The parameter count is taken on the meta device before anything is allocated: a config that kept
a full-size vocabulary or width could otherwise take gigabytes (and the machine) with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch

SEQ = 16
MAX_PARAMS = 10_000_000  # the recipe yields ~0.1-1 M; more means the config ignored it


@dataclass(frozen=True)
class Shape:
    """The sizes one zoo run builds every architecture at (``TINY`` spells them per config field)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool
    experts: int
    experts_per_token: int
    intermediate: int
    expert_intermediate: int

    def describe(self) -> str:
        grouping = "no grouping" if self.kv_heads == self.heads else f"{self.heads // self.kv_heads} heads per KV head"
        return (f"hidden {self.hidden}, {self.heads} heads over {self.kv_heads} KV head{'s' * (self.kv_heads > 1)} "
                f"({grouping}), head size {self.head_dim}"
                f"{'' if self.head_dim * self.heads == self.hidden else ' (not hidden/heads)'}, {self.layers} layers, "
                f"vocabulary {self.vocab} ({'tied' if self.tied else 'untied'} head), intermediate {self.intermediate}, "
                f"{self.experts} experts with {self.experts_per_token} per token")


# ``base``: the shape the zoo was first run at. The others vary what a tensor or pipeline split depends
# on: heads per KV head (3, 1 and 4, and one KV head for all), a head size other than hidden / heads,
# odd vocabularies under a tied head (padded when split by rows), layer counts that two stages cannot
# split evenly, more experts and more of them per token.
SHAPES = {
    "base": Shape("base", hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=128, tied=False,
                  experts=4, experts_per_token=2, intermediate=128, expert_intermediate=32),
    "gqa3": Shape("gqa3", hidden=96, heads=6, kv_heads=2, head_dim=16, layers=3, vocab=131, tied=True,
                  experts=6, experts_per_token=2, intermediate=192, expert_intermediate=48),
    "mha8": Shape("mha8", hidden=96, heads=8, kv_heads=8, head_dim=8, layers=5, vocab=203, tied=False,
                  experts=8, experts_per_token=3, intermediate=160, expert_intermediate=40),
    "mqa": Shape("mqa", hidden=64, heads=4, kv_heads=1, head_dim=16, layers=3, vocab=97, tied=True,
                 experts=4, experts_per_token=2, intermediate=128, expert_intermediate=32),
}


def tiny_fields(shape: Shape) -> dict:
    """field -> value, set on every config that has the field (directly or through attribute_map)."""
    h, n, kv, d, layers = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.layers
    f, fe = shape.intermediate, shape.expert_intermediate
    return {
        "vocab_size": shape.vocab,
        "hidden_size": h, "n_embd": h, "d_model": h, "embed_dim": h,
        # embeddings of their own width (OPT's projection, RoFormer, ELECTRA, RemBERT), else they dominate
        "word_embed_proj_dim": h, "embedding_size": h, "input_embedding_size": h, "output_embedding_size": h,
        "intermediate_size": f, "ffn_dim": f, "n_inner": f, "d_ff": f,
        "num_hidden_layers": layers, "n_layer": layers, "num_layers": layers, "n_layers": layers,
        "encoder_layers": layers, "decoder_layers": layers, "encoder_ffn_dim": f, "decoder_ffn_dim": f,
        "num_attention_heads": n, "n_head": n, "num_heads": n, "n_heads": n,
        "encoder_attention_heads": n, "decoder_attention_heads": n,
        "num_key_value_heads": kv, "n_kv_heads": kv, "num_kv_heads": kv, "multi_query_group_num": kv,
        "head_dim": d, "kv_channels": d, "rotary_dim": d,
        "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
        "use_cache": False, "tie_word_embeddings": shape.tied,
        # mixture of experts
        "num_experts": shape.experts, "num_local_experts": shape.experts, "n_routed_experts": shape.experts,
        "moe_num_experts": shape.experts,
        "num_experts_per_tok": shape.experts_per_token, "moe_topk": shape.experts_per_token,
        "moe_k": shape.experts_per_token,
        "moe_intermediate_size": fe, "expert_intermediate_size": fe, "shared_expert_intermediate_size": fe,
        # multi-head latent attention (DeepSeek-V2 style)
        "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": d,
        "router_jitter_noise": 0.0,
    }


DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "dropout_rate")


def architectures() -> list[str]:
    """Model types that have a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _has(config, name: str) -> bool:
    return hasattr(config, name) or name in getattr(config, "attribute_map", {})


def tiny_config(model_type: str, shape: Shape = SHAPES["base"]):
    """The architecture's default config shrunk to ``shape`` (only fields it already has), and so
    are the configs nested in it (the text model inside a multimodal one, an encoder, ...)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])()
    _shrink(config, shape, tiny_fields(shape))
    return config


def _shrink(config, shape: Shape, fields: dict) -> None:
    from transformers import PretrainedConfig

    for name, value in fields.items():
        if _has(config, name):
            _set(config, name, value)
    for name in list(vars(config)):
        value = getattr(config, name)
        if isinstance(value, PretrainedConfig):
            _shrink(value, shape, fields)
        if any(word in name for word in DROPOUT_WORDS) and isinstance(value, float):
            _set(config, name, 0.0)
        if name.endswith("_token_id") and isinstance(value, int) and value >= shape.vocab:
            _set(config, name, shape.vocab - 1)  # special tokens must index the small vocabulary
    if _has(config, "qk_rope_head_dim"):  # multi-head latent attention: head_dim is the rotary part
        _set(config, "head_dim", fields["qk_rope_head_dim"])
    layers = getattr(config, "num_hidden_layers", None)
    for name in ("layer_types", "block_types"):
        if isinstance(getattr(config, name, None), list) and layers:
            _set(config, name, _stretch(getattr(config, name), layers))


def _stretch(types: list, layers: int) -> list:
    """A per-layer type list of the default config, cut or repeated to ``layers`` entries."""
    return [types[i % len(types)] for i in range(layers)]


def _set(config, name: str, value) -> None:
    """Set a field unless the config derives it (a read-only property or a refused setter)."""
    try:
        setattr(config, name, value)
    except (AttributeError, NotImplementedError):
        pass


def meta_parameter_count(config) -> int:
    """Parameters of the causal LM built from ``config``, counted without allocating them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


class ZooLM(L.LightningModule):
    """A plain user module: the model's own loss from ``labels``, AdamW, float32.

    ``lr=1e-3`` and ``eps=1e-6``: every AdamW step moves each parameter by about ``lr``, so a
    shard that was not reduced or a weight that was not updated shows up at ~1e-3, ten times the
    zoo's parameter tolerance; ``eps`` keeps Adam from blowing float noise on exactly-zero
    gradients (a key bias under softmax) up to full steps.
    """

    def __init__(self, config, lr: float = 1e-3):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.lr = lr
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


def token_batches(steps: int, batch: int, vocab: int) -> torch.Tensor:
    """``steps * batch`` random sequences of ``SEQ`` tokens below ``vocab``, the same on every call."""
    return torch.randint(0, vocab, (steps * batch, SEQ), generator=torch.Generator().manual_seed(1))
