"""Six kinds of module for ``plan_vs_measured.py``, each with its data: what the planner is measured on.

* ``dense``: the package's GPT (its sizes named ``n_embd``, ``n_head``, ``vocab_size``: the shortcut);
* ``moe``: a tiny Hugging Face Mixtral (routed experts; sizes in its config);
* ``cnn``: the ResNet-50-shaped network of ``tests/helpers/resnet.py`` on 32x32 images;
* ``encoder``: token classification over an ``nn.TransformerEncoder`` (post-norm layers, padding-free);
* ``transformer``: ``nn.Transformer`` (encoder and decoder) learning to copy a sequence;
* ``custom``: a module naming none of its sizes (``nn.MultiheadAttention`` blocks, ``vocab``/``d``/``heads``).

Every model but the ResNet's optimizer is AdamW, which the memory estimate assumes (``planner/estimate.py``).
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from tests.helpers.parity import TensorDataset

SEQ, VOCAB = 16, 64


class _AdamW:
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Custom(_AdamW, L.LightningModule):
    def __init__(self, vocab: int = VOCAB, d: int = 128, heads: int = 4, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y.flatten())


class Encoder(_AdamW, L.LightningModule):
    def __init__(self, vocab: int = VOCAB, d: int = 128, heads: int = 4, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.classify = nn.Linear(d, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.classify(self.encoder(self.embed(x))).flatten(0, 1),
                                           (y % 8).flatten())


class Seq2Seq(_AdamW, L.LightningModule):
    def __init__(self, vocab: int = VOCAB, d: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, heads, layers, layers, 4 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.transformer(self.embed(x), self.embed(y))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), x.flatten())


class AdamWResNet(_AdamW, L.LightningModule):
    """The tests' ResNet with AdamW instead of SGD with momentum (what the estimate assumes)."""

    def __init__(self):
        super().__init__()
        from tests.helpers.resnet import ResNet

        self.net = ResNet(width=8)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)


class Mixtral(_AdamW, L.LightningModule):
    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss


def dense():
    from lightning_parallel.models.gpt import GPT

    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128)


def tokens(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(x[:, :-1], x[:, 1:])


def images(n: int = 64) -> TensorDataset:
    from tests.helpers.resnet import image_data

    return image_data(n, size=32)


# name -> (model factory, dataset factory)
MODELS = {
    "dense": (dense, tokens),
    "moe": (Mixtral, tokens),
    "cnn": (AdamWResNet, images),
    "encoder": (Encoder, tokens),
    "transformer": (Seq2Seq, tokens),
    "custom": (Custom, tokens),
}
