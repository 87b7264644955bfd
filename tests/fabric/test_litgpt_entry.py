"""LitGPT's own ``finetune_full`` entry point (``litgpt.finetune.full.setup``) on our strategy, by one line,
at parity with its one-device run: a tiny LitGPT checkpoint, tokenizer and JSON data on disk."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoint.consolidate import load_directory
from lightning_parallel.fabric import FabricParallelStrategy
from tests.helpers.parity import PARAM_BOUND, assert_params_close
from tests.helpers.processes import start_ranks


def tiny_checkpoint(folder: Path, n_query_groups: int = 2) -> Path:
    """What ``litgpt download`` leaves: ``model_config.yaml``, ``lit_model.pth`` and a tokenizer (one token
    per character); and 16 samples whose answers have one length (the loss is a mean over tokens, so every
    micro-batch weighs alike, whichever samples it pairs). ``n_query_groups=4`` (one KV head per query head)
    gives a fused qkv of three equal blocks, which tensor parallelism splits."""
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    checkpoint = folder / f"checkpoint{n_query_groups}"
    checkpoint.mkdir(parents=True)
    config = Config(name="tiny", block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=4, n_embd=32,
                    n_query_groups=n_query_groups, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    save_config(config, checkpoint)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), checkpoint / "lit_model.pth")
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:#\n":
        vocab.setdefault(c, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    samples = [{"instruction": "count", "input": "", "output": "".join(chr(97 + (k + j) % 26) for j in range(8))}
               for k in range(16)]
    if not (folder / "data.json").exists():
        (folder / "data.json").write_text(json.dumps(samples))
    return checkpoint


def finetune(folder: Path, checkpoint: Path, devices: int, global_batch_size: int = 12, run: str = "") -> Path:
    """``litgpt finetune_full`` as its entry point runs it; each step reads the whole training set (12
    samples: 6 micro-batches of 2 on one device, 3 per rank on two), so every layout sums the same
    gradients."""
    import litgpt.finetune.full as full
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON

    out = folder / f"out{devices}{run}"
    full.setup(checkpoint, out_dir=out, precision="32-true", devices=devices,
               data=JSON(folder / "data.json", val_split_fraction=0.25),
               train=TrainArgs(save_interval=2, log_interval=1, global_batch_size=global_batch_size, micro_batch_size=2,
                               lr_warmup_steps=1, epochs=3, max_seq_length=64),
               eval=EvalArgs(interval=100, max_new_tokens=2, max_iters=1, initial_validation=False,
                             final_validation=False),
               optimizer="AdamW", logger_name="csv", seed=1)
    return out / "final" / "lit_model.pth"


@pytest.mark.timeout(600)
def test_litgpt_finetune_full_on_two_processes_matches_one_device(tmp_path, monkeypatch):
    """By one line at DP2, and at ZeRO-3, where LitGPT's ``load_checkpoint`` loads the whole checkpoint into the
    sharded model with ``load_state_dict`` (each rank takes its rows: ``strategy/whole_state_dict.py``)."""
    import litgpt.finetune.full as full

    checkpoint = tiny_checkpoint(tmp_path)
    monkeypatch.setattr(sys, "argv", ["litgpt", str(checkpoint)])  # litgpt records its command line's arguments
    reference = torch.load(finetune(tmp_path, checkpoint, devices=1), weights_only=True)["model"]
    initial = torch.load(checkpoint / "lit_model.pth", weights_only=True)
    assert max((reference[k] - initial[k]).abs().max() for k in initial) > 10 * PARAM_BOUND  # it trained
    for options in ({}, {"zero_stage": 3}):
        # the one line: LitGPT builds FSDPStrategy for several devices; ours takes its place
        monkeypatch.setattr(full, "FSDPStrategy", lambda **fsdp: FabricParallelStrategy(start_method="fork", **options))
        saved = finetune(tmp_path, checkpoint, devices=2, run="".join(options))
        assert saved.is_dir()  # a Distributed Checkpoint directory, read back whole on one process
        weights = load_directory(saved, "cpu", False)["state_dict"]
        assert_params_close(weights, reference, atol=PARAM_BOUND)


@pytest.mark.timeout(600)
def test_litgpt_finetune_full_at_tp2_matches_one_device(tmp_path, monkeypatch):
    """At TP2 (plan detection splits the fused qkv of equal blocks): LitGPT counts every device as a
    data-parallel rank, so the global batch is given twice over for the two TP ranks of one replica."""
    import litgpt.finetune.full as full

    checkpoint = tiny_checkpoint(tmp_path, n_query_groups=4)
    monkeypatch.setattr(sys, "argv", ["litgpt", str(checkpoint)])
    reference = torch.load(finetune(tmp_path, checkpoint, devices=1), weights_only=True)["model"]
    monkeypatch.setattr(full, "FSDPStrategy",
                        lambda **fsdp: FabricParallelStrategy(start_method="fork", tensor_parallel=2))
    saved = finetune(tmp_path, checkpoint, devices=2, global_batch_size=24)
    weights = load_directory(saved, "cpu", False)["state_dict"]
    assert_params_close(weights, reference, atol=PARAM_BOUND)


class _TokenRows:
    """A LitGPT ``DataModule`` over fixed rows of token ids (``pretrain`` reads ``max_seq_length + 1``
    tokens per row): 24 for training, 4 for validation, in order."""

    def __new__(cls, *args, **kwargs):
        from litgpt.data import DataModule

        class TokenRows(DataModule):
            def connect(self, tokenizer=None, batch_size=1, max_seq_length=None, **kwargs):
                self.batch_size, self.length = batch_size, max_seq_length + 1

            def rows(self, first, count):
                generator = torch.Generator().manual_seed(first)
                return torch.randint(0, 128, (count, self.length), generator=generator)

            def train_dataloader(self):
                return torch.utils.data.DataLoader(self.rows(0, 24), batch_size=self.batch_size)

            def val_dataloader(self):
                return torch.utils.data.DataLoader(self.rows(1, 4), batch_size=self.batch_size)

        return TokenRows()


def pretrain(folder: Path, devices: int, run: str = "") -> dict:
    """``litgpt pretrain`` on a tiny config from random initial values: 3 optimizer steps of 8 rows (4
    micro-batches of 2 on one device, 2 per rank on two), clipped at norm 1, at a constant learning rate
    (``min_lr`` = ``lr``: pretrain's schedule reads the rate at a step's last micro-batch from the count of
    micro-batches before it, which differs with the number of devices); returns one device's final
    weights (several write a Distributed Checkpoint directory)."""
    import litgpt.pretrain as pretrain_script
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config

    config = Config(name="tiny", block_size=16, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=4, n_embd=32,
                    n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    out = folder / f"pretrain{devices}{run}"
    pretrain_script.setup("tiny", model_config=config, out_dir=out, precision="32-true", devices=devices,
                          data=_TokenRows(),
                          train=TrainArgs(save_interval=None, log_interval=1, global_batch_size=8, micro_batch_size=2,
                                          lr_warmup_steps=0, min_lr=1e-3, max_tokens=12 * 2 * 16, max_norm=1.0),
                          eval=EvalArgs(interval=100, max_iters=1, initial_validation=False, final_validation=False),
                          optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}, logger_name="csv",
                          seed=1)
    return torch.load(out / "final" / "lit_model.pth", weights_only=False)["model"] if devices == 1 else {}


@pytest.mark.timeout(600)
def test_litgpt_pretrain_on_two_processes_matches_one_device(tmp_path, monkeypatch):
    """``pretrain`` builds the model under ``init_module(empty_init=True)`` and initialises it after
    construction, which it leaves to FSDP: our strategy, standing in for FSDP, records that
    initialisation and each rank replays it for its part (at DP2, and at ZeRO-3: its rows)."""
    import litgpt.pretrain as pretrain_script

    monkeypatch.setattr(sys, "argv", ["litgpt", "tiny"])  # litgpt records its command line's arguments
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)  # pretrain compiles; slow on CPU
    reference = pretrain(tmp_path, devices=1)
    for options in ({}, {"zero_stage": 3}):
        # the one line: pretrain builds FSDPStrategy for several devices; ours stands in for it
        monkeypatch.setattr(pretrain_script, "FSDPStrategy", FabricParallelStrategy.standing_in_for_fsdp(**options))
        # pretrain calls fabric.launch() without a function: its processes are started as torchrun starts them
        run = "".join(options)
        logs = tmp_path / f"logs{run}"
        ranks = start_ranks(lambda rank: pretrain(tmp_path, devices=2, run=run), 2, str(logs))
        for rank, process in enumerate(ranks):
            process.join(timeout=500)
            assert process.exitcode == 0, (logs / f"rank{rank}.log").read_text()[-3000:]
        weights = load_directory(tmp_path / f"pretrain2{run}" / "final" / "lit_model.pth", "cpu", False)["state_dict"]
        assert set(weights) == set(reference)
        assert_params_close(weights, reference, atol=PARAM_BOUND)
