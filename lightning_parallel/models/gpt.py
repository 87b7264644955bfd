"""A plain GPT language model as a LightningModule: the embedded default of `lp-train`.

The architecture is GPT-2 (Radford et al., 2019, "Language Models are Unsupervised Multitask
Learners"): pre-LayerNorm transformer blocks of causal self-attention and a 4x GELU MLP, learned
position embeddings, and an output head tied to the token embedding (Press & Wolf, 2017, "Using
the Output Embedding to Improve Language Models"). Layout and initialisation follow nanoGPT.

This file imports nothing from `lightning_parallel` on purpose: it is the proof that a module
written for one device trains unchanged under data, tensor and pipeline parallelism. Two details
make that possible and must stay: attention infers its local head count with `view(B, T, -1,
head_dim)`, so a column-sharded `c_attn` just sees fewer heads, and every submodule keeps the
nanoGPT name (`transformer.h.0.attn.c_attn`, ...) that the parallel plans refer to.
"""

from __future__ import annotations

import math
from functools import partial

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position attends only to itself and earlier ones."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim); heads is whatever this rank holds
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: expand 4x, GELU, project back."""

    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _linear_warmup(step: int, warmup_steps: int) -> float:
    """LR multiplier that ramps linearly from 1/warmup_steps to 1, then stays at 1."""
    return min(1.0, (step + 1) / warmup_steps)


class GPT(L.LightningModule):
    """Decoder-only transformer trained on next-token prediction.

    `forward(idx)` maps token ids (B, T) to logits (B, T, vocab_size). A batch is a pair
    `(x, y)` of int64 tensors (B, T) where `y` is `x` shifted left by one token.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.val_loss_mean = MeanMetric()
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer), since each block adds
        # two of them to the residual stream and its variance would otherwise grow with depth.
        for block in self.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.init_std_scale = 1 / math.sqrt(2 * n_layer)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Per-module init, so it can be replayed module by module (e.g. after meta-device creation)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02 * getattr(module, "init_std_scale", 1.0))
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.hparams.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.hparams.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.val_loss_mean.update(loss, weight=batch[1].numel())

    def on_validation_epoch_end(self):
        # Perplexity is exp of the token-weighted mean loss over the whole validation set.
        # MeanMetric sums (loss * tokens, tokens) across all processes before dividing, so
        # ranks that saw no batches (or duplicate ones of equal size) leave the value exact.
        # It is then equal on every rank; sync_dist only tells Lightning so.
        self.log("val_ppl", torch.exp(self.val_loss_mean.compute()), sync_dist=True)
        self.val_loss_mean.reset()

    def configure_optimizers(self):
        # Decay only matrices (linear and embedding weights), not biases or LayerNorm gains.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        if self.hparams.warmup_steps <= 0:
            return optimizer
        warmup = partial(_linear_warmup, warmup_steps=self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
