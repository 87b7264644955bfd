"""An unchanged Lightning Fabric training loop on a tiny Hugging Face Llama, and how the tests run it.

``train`` is the loop a Fabric user writes (``init_module``, ``setup``, ``setup_dataloaders``,
``backward``, ``clip_gradients`` by the global norm, ``save`` and ``load`` mid-run, ``all_reduce``); the
tests run it once on one device and once on N fork-started processes with the same seed and the same
global batches, and compare the records (``tests/helpers/parity.py``'s bound).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from tests.helpers.parity import ReplicaBatches, TensorDataset
from tests.helpers.processes import run_distributed

STEPS, MAX_NORM, LR = 4, 0.5, 1e-2


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def tiny_litgpt() -> torch.nn.Module:
    """LitGPT's own ``GPT`` (Llama-style: RMSNorm, SwiGLU, 4 query heads over 2 KV heads, fused ``qkv``)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                      n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                      norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64))


def tiny_mixtral() -> torch.nn.Module:
    """A Hugging Face Mixture-of-Experts LM: 4 experts per layer, 2 per token."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                            num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The loss as each model's own loop computes it: Hugging Face's from ``labels``, LitGPT's from logits."""
    if hasattr(model, "lm_head") and hasattr(model, "transformer"):  # LitGPT
        logits = model(batch)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    return model(input_ids=batch, labels=batch).loss


MODELS = {"llama": tiny_llama, "litgpt": tiny_litgpt, "mixtral": tiny_mixtral}


def build(model_name: str) -> torch.nn.Module:
    """A model of ``MODELS``, or ``"pretrained:<folder>"``: a Hugging Face Llama read with ``from_pretrained``."""
    if model_name.startswith("pretrained:"):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(model_name.split(":", 1)[1])
    return MODELS[model_name]()


def counting_data(n: int = 32, length: int = 16) -> TensorDataset:
    """Sequences counting up from random offsets: learnable, so the loss falls."""
    offsets = torch.randint(0, 64, (n, 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset((offsets + torch.arange(length)) % 64)


def whole_parameters(model: torch.nn.Module, mesh: Any = None) -> dict[str, torch.Tensor]:
    """Every parameter as one device holds it: ZeRO-2/3 rows gathered over the replicas, TP shards over
    the TP group, experts over the expert-parallel group (collectives)."""
    from torch.distributed.tensor import DTensor

    from lightning_parallel.tensor_parallel import gather_full_tensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if getattr(p, "tp_shard", None) is not None and mesh is not None and mesh.tp_size > 1:
            t = gather_full_tensor(t, p.tp_shard, mesh)
        if hasattr(p, "expert_shard") and mesh is not None and mesh.ep_size > 1:  # experts by global id
            parts = [torch.empty_like(t) for _ in range(mesh.ep_size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=mesh.ep_group)
            t = torch.cat(parts)
        out[name] = t.detach().cpu().clone()
    return out


def train(fabric: Any, loader: DataLoader, checkpoint: Optional[str], empty_init: bool = False,
          save_at: int = 1, resume: Optional[str] = None, accumulate: int = 1,
          model_name: str = "llama", pipelined: bool = False) -> dict[str, Any]:
    """The user's loop; returns the losses (mean over replicas), gradient norms and whole parameters."""
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=empty_init):
        model = build(model_name)
    built_on_meta = all(p.is_meta for p in model.parameters())
    lengths: list[int] = []  # the sequence length the second block sees (a probe, not part of the loop)
    if model_name == "llama" or model_name.startswith("pretrained:"):
        model.model.layers[1].register_forward_pre_hook(
            lambda m, args, kwargs: lengths.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    losses, norms = [], []
    for i, batch in enumerate(loader):
        if i < state["step"]:
            continue  # the batches before the checkpoint
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            if pipelined:  # the model runs the schedule over micro-batches, forward and backward
                loss = model(batch, loss_fn=next_token_loss, loss_scale=1.0 / accumulate)  # the batch's loss
                fabric.backward(loss)
            else:
                loss = next_token_loss(model, batch)
                fabric.backward(loss / accumulate)
        if not last:
            continue
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        state["step"] = i + 1
        if checkpoint is not None and i == save_at:
            fabric.save(checkpoint, state)
            state["step"] = -1
            fabric.load(checkpoint, state)  # what was saved comes back
            assert state["step"] == i + 1
    fabric.barrier()
    mesh = getattr(fabric.strategy, "mesh", None)
    from lightning_parallel.mesh import local_part

    held = sum(local_part(p).numel() for p in model.module.parameters())  # what this rank holds of the model
    model = model.module  # the user's module, as Fabric's wrapper exposes it (names as on one device)
    return {"losses": losses, "norms": norms, "params": whole_parameters(model, mesh), "meta": built_on_meta,
            "held": held, "lengths": sorted(set(lengths)),
            "replicas": float(fabric.all_reduce(torch.ones(()), reduce_op="sum")),
            "broadcast": fabric.broadcast(fabric.global_rank + 7, src=0)}


def one_device(replicas: int, per_rank: int, checkpoint: Optional[str] = None, **kwargs: Any) -> dict[str, Any]:
    """The loop under Fabric on one CPU, reading at step k the union of what ``replicas`` ranks read."""
    from lightning.fabric import Fabric

    data = counting_data()
    loader = DataLoader(data, batch_sampler=ReplicaBatches(len(data), replicas, per_rank, seed=0))  # train() seeds 0
    return train(Fabric(accelerator="cpu", devices=1), loader, checkpoint, **kwargs)


def _rank(rank: int, world_size: int, strategy: Any, per_rank: int, checkpoint: Optional[str],
          kwargs: dict) -> dict[str, Any]:
    from lightning.fabric import Fabric

    # as torchrun starts them: Fabric joins the processes it finds (the process group exists already)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    if callable(strategy):
        strategy = strategy()
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    loader = DataLoader(counting_data(), batch_size=per_rank, shuffle=True)
    return train(fabric, loader, checkpoint, **kwargs)


def distributed(strategy: Any, world_size: int, per_rank: int, checkpoint: Optional[str] = None,
                timeout: float = 120.0, **kwargs: Any) -> list[dict[str, Any]]:
    """The loop on ``world_size`` fork-started processes under ``strategy`` (a name, or a callable that
    builds the strategy in each process); one record per rank."""
    return run_distributed(_rank, world_size, strategy, per_rank, checkpoint, kwargs, timeout=timeout)
