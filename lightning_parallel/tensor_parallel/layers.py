"""Megatron-LM's tensor-parallel layers (Shoeybi et al. 2019, arXiv 1909.08053, §3).

Each layer holds only its shard of the weights and is built from an existing ``nn.Linear`` /
``nn.Embedding`` whose full weights are already identical on every TP rank (see ``plan.py``), so
a shard is exactly the matching slice of the single-device initialisation.

With ``sequence_parallel`` (Korthikanti et al. 2022, arXiv 2205.05198) the activations between
layers are split along the sequence: a column layer all-gathers its input instead of the ``f``
identity, and a row layer reduce-scatters its output instead of the ``g`` all-reduce.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .comm import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
    sum_over_copies,
)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with the rows of ``A`` (output features) split across TP ranks.

    The input is replicated (or, with sequence parallelism, a sequence shard that is gathered);
    the output is this rank's slice of the features, or the full features when ``gather_output``
    (trimmed to ``out_features`` when the rows were padded). ``transposed``: the weight is stored
    ``(in, out)``, as in Hugging Face's ``Conv1D`` (GPT-2), and keeps that layout. ``copies``: that
    many consecutive TP ranks hold the same rows (a key or value head shared by their query heads,
    ``kv_heads.py``), whose weight and bias gradients are summed over those ranks.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: Optional[nn.Parameter],
        group,
        out_features: int,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        transposed: bool = False,
        copies: int = 1,
    ) -> None:
        super().__init__()
        self.weight = weight  # (out / tp, in), or (in, out / tp) when transposed; out * copies / tp with copies
        self.bias = bias  # (out / tp,) or None
        self.group = group
        self.transposed = transposed
        self.in_features = weight.shape[0 if transposed else 1]
        self.out_features = out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.copies = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group)  # (b, s/tp, in) -> (b, s, in)
        else:
            x = copy_to_region(x, self.group)  # f: identity, all-reduce in backward
        weight, bias = self.weight, self.bias
        if self.copies > 1:  # identity forward; the copies' gradients summed in backward
            weight = sum_over_copies(weight, self.group, self.copies)
            bias = None if bias is None else sum_over_copies(bias, self.group, self.copies)
        weight = weight.t() if self.transposed else weight
        y = F.linear(x, weight, bias)  # (b, s, in) @ (in, out/tp) = (b, s, out/tp)
        if self.gather_output:
            y = gather_from_region(y, self.group)  # (b, s, out) (padded)
            if y.shape[-1] != self.out_features:
                y = y[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local_out={self.weight.shape[1 if self.transposed else 0]}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}" + (f", copies={self.copies}" if self.copies > 1 else "")
        )


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with the columns of ``A`` (input features) split across TP ranks.

    The input is already split along its last dimension (the output of a column layer); the
    partial products are summed across ranks (or reduce-scattered along the sequence) and the
    bias, which is replicated, is added once after that reduction. ``transposed`` as in
    ``ColumnParallelLinear``. ``split_input``: the input is replicated (it comes from code between
    a gathered column layer and this one, e.g. Phi-3's slicing of a fused QKV); each rank keeps
    its slice of the features (``fused`` blocks, each sliced alike), and the backward all-gathers.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: Optional[nn.Parameter],
        group,
        in_features: int,
        sequence_parallel: bool = False,
        transposed: bool = False,
        split_input: bool = False,
        fused: int = 1,
    ) -> None:
        super().__init__()
        self.weight = weight  # (out, in / tp), or (in / tp, out) when transposed
        self.bias = bias  # (out,) replicated
        self.group = group
        self.transposed = transposed
        self.in_features = in_features
        self.out_features = weight.shape[1 if transposed else 0]
        self.sequence_parallel = sequence_parallel
        self.split_input = split_input
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:  # (b, s, in) -> (b, s, in/tp): this rank's slice of each fused block
            x = torch.cat([scatter_to_region(b, self.group) for b in x.chunk(self.fused, dim=-1)], dim=-1)
        y = F.linear(
            x, self.weight.t() if self.transposed else self.weight
        )  # (b, s, in/tp) @ (in/tp, out) = (b, s, out), partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group)  # (b, s/tp, out)
        else:
            y = reduce_from_region(y, self.group)  # g: all-reduce
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local_in={self.weight.shape[0 if self.transposed else 1]}, sequence_parallel={self.sequence_parallel}, "
            f"split_input={self.split_input}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split across TP ranks.

    Each rank looks up the ids in its row range ``[start, start + rows)``, zeroes the rows of ids
    it does not own, and the partial results are summed across ranks (Megatron's
    ``VocabParallelEmbedding``); with sequence parallelism the sum is a reduce-scatter along the
    sequence, which is where the sequence-parallel region begins. ``embed_scale``: a factor the
    embedding's own forward multiplied its output by, in the same form: a tensor cast to the output's
    dtype first, kept as the same non-persistent buffer (Gemma's scaled word embedding), or a Python
    number (BioGPT's), which a low-precision product keeps at full precision.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        group,
        tp_rank: int,
        num_embeddings: int,
        padding_idx: Optional[int] = None,
        sequence_parallel: bool = False,
        embed_scale: Optional[Union[torch.Tensor, float]] = None,
    ) -> None:
        super().__init__()
        self.weight = weight  # (padded vocab / tp, dim)
        tensor = isinstance(embed_scale, torch.Tensor)
        self.register_buffer("embed_scale", embed_scale if tensor else None, persistent=False)
        self.scalar_scale = None if tensor else embed_scale
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = weight.shape[1]
        self.vocab_start = tp_rank * weight.shape[0]
        self.padding_idx = padding_idx
        self.sequence_parallel = sequence_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + rows)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        local_pad = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < rows:
            local_pad = self.padding_idx - self.vocab_start
        out = F.embedding(local_ids, self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        elif self.scalar_scale is not None:
            out = out * self.scalar_scale
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group)
        return reduce_from_region(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"local_rows={self.weight.shape[0]}, vocab_start={self.vocab_start}"
        )
