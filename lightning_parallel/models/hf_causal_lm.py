"""A Hugging Face causal language model (Llama by default) as a plain LightningModule.

The network is built from a config with random weights (`AutoModelForCausalLM.from_config`), so
nothing is downloaded; the recipes use it for a Llama-style model (Touvron et al. 2023, "Llama 2",
arXiv 2307.09288). Given `pretrained` (a folder written by `save_pretrained`), it loads that model
with `from_pretrained` instead: the fine-tuning recipe. Like `gpt.GPT`, it imports nothing from `lightning_parallel`: the strategies
shard it through the model's own `base_model_tp_plan` and split its `model.layers` into stages.

Batches are `(x, y)` with `y` already shifted by one token (see `data.text`). The loss is
therefore computed here from the logits: passing `labels=` to a Hugging Face causal LM would
shift the targets a second time.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig


class HFCausalLM(L.LightningModule):
    """`LlamaForCausalLM(LlamaConfig(**config))`, or the model saved in `pretrained`, trained on
    next-token prediction with AdamW.

    Args:
        config: keyword arguments of `transformers.LlamaConfig` (hidden_size, num_hidden_layers, ...);
            ignored when `pretrained` is given.
        pretrained: a folder with a Hugging Face model (`config.json` and safetensors weights).
        lr, weight_decay, betas: AdamW settings; weight decay applies to matrices only.
    """

    def __init__(
        self,
        config: Optional[dict[str, Any]] = None,
        pretrained: Optional[str] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ):
        super().__init__()
        self.save_hyperparameters()
        if pretrained is not None:
            self.model = AutoModelForCausalLM.from_pretrained(pretrained)
            self.model.train()  # from_pretrained returns the model in evaluation mode; this module trains it
        elif config is not None:
            self.model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
        else:
            raise ValueError("HFCausalLM needs a config (a new model) or pretrained (a saved model's folder)")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))
