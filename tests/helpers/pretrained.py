"""A tiny pretrained Hugging Face model on disk, as ``save_pretrained`` writes it (no download)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(path: Path, vocab: int = 128, layers: int = 4, tied: bool = False, seed: int = 123) -> str:
    """Save a tiny Llama (hidden 64, 4 heads over 2 KV heads) to ``path``; its weights are perturbed away
    from a fresh initialisation (std 0.02), so a run that initialises instead of loading shows at once."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return str(path)
