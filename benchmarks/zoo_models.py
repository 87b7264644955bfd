"""Every causal-LM architecture of the installed ``transformers``, as a tiny LightningModule.

One generic recipe, no per-model tuning and no download: instantiate the architecture's config
class with no arguments, then set whichever of the size fields below it has (under its own name or
through ``attribute_map``): 2 blocks, hidden 64, 4 heads, 2 KV heads, vocab 128, dropouts 0, no
cache, untied head, small MoE and MLA sizes. Architectures whose config ignores or contradicts
these sizes fail to build or train here, which says nothing about parallelism; the zoo only keeps
the ones that train on one process.

The parameter count is taken on the meta device before anything is allocated: a config that kept
a full-size vocabulary or width could otherwise take gigabytes (and the machine) with it.
"""

from __future__ import annotations

import lightning as L
import torch

VOCAB, SEQ = 128, 16
MAX_PARAMS = 10_000_000  # the recipe yields ~0.1-1 M; more means the config ignored it

# field -> value, set on every config that has the field (directly or through attribute_map)
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "rotary_dim": 16,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "use_cache": False, "tie_word_embeddings": False,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    # multi-head latent attention (DeepSeek-V2 style)
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "router_jitter_noise": 0.0,
}
DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "dropout_rate")


def architectures() -> list[str]:
    """Model types that have a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _has(config, name: str) -> bool:
    return hasattr(config, name) or name in getattr(config, "attribute_map", {})


def tiny_config(model_type: str):
    """The architecture's default config shrunk by ``TINY`` (only fields it already has), and so
    are the configs nested in it (the text model inside a multimodal one, an encoder, ...)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])()
    _shrink(config)
    return config


def _shrink(config) -> None:
    from transformers import PretrainedConfig

    for name, value in TINY.items():
        if _has(config, name):
            _set(config, name, value)
    for name in list(vars(config)):
        value = getattr(config, name)
        if isinstance(value, PretrainedConfig):
            _shrink(value)
        if any(word in name for word in DROPOUT_WORDS) and isinstance(value, float):
            _set(config, name, 0.0)
        if name.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            _set(config, name, VOCAB - 1)  # special tokens must index the small vocabulary
    if _has(config, "qk_rope_head_dim"):  # multi-head latent attention: head_dim is the rotary part
        _set(config, "head_dim", TINY["qk_rope_head_dim"])
    layers = getattr(config, "num_hidden_layers", None)
    for name in ("layer_types", "block_types"):
        if isinstance(getattr(config, name, None), list) and layers:
            _set(config, name, getattr(config, name)[:layers])


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


def token_batches(steps: int, batch: int) -> torch.Tensor:
    """``steps * batch`` random sequences of ``SEQ`` tokens, the same on every call."""
    return torch.randint(0, VOCAB, (steps * batch, SEQ), generator=torch.Generator().manual_seed(1))
