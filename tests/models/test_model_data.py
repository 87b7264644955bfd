"""The embedded GPT and byte-level text data keep the promises the parallel plans rely on."""

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_parallel.data.text import TextDataModule, text_files
from lightning_parallel.models.gpt import GPT, CausalSelfAttention
from tests.helpers.processes import run_distributed

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.timeout(10)
def test_gpt_maps_token_ids_to_logits_per_position():
    model = GPT(**TINY)
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)


@pytest.mark.timeout(10)
def test_lm_head_is_tied_to_token_embedding():
    model = GPT(**TINY)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) + ("transformer.wte.weight" in names) == 1


@pytest.mark.timeout(10)
def test_nanogpt_module_names_are_kept():
    names = {n for n, _ in GPT(**TINY).named_parameters()}
    for expected in (
        "transformer.wpe.weight", "transformer.ln_f.weight",
        "transformer.h.1.ln_1.weight", "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.weight", "transformer.h.1.ln_2.bias",
        "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.bias",
    ):
        assert expected in names


@pytest.mark.timeout(10)
def test_earlier_positions_do_not_see_later_tokens():
    model = GPT(**TINY).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.timeout(10)
def test_attention_with_column_sharded_c_attn_computes_its_heads_share():
    # Megatron TP gives each rank a slice of heads: rows of c_attn (q, k and v for those heads)
    # and the matching columns of c_proj. Partial outputs must sum to the full output.
    torch.manual_seed(0)
    d, heads, shards = 32, 4, 2
    full = CausalSelfAttention(d, heads, dropout=0.0)
    x = torch.randn(2, 8, d)
    partial_sum = 0
    for s in range(shards):
        part = CausalSelfAttention(d, heads, dropout=0.0)
        width = d // shards
        rows = torch.cat([torch.arange(j * d + s * width, j * d + (s + 1) * width) for j in range(3)])
        part.c_attn = nn.Linear(d, 3 * width)
        part.c_attn.weight.data = full.c_attn.weight.data[rows]
        part.c_attn.bias.data = full.c_attn.bias.data[rows]
        part.c_proj = nn.Linear(width, d, bias=False)
        part.c_proj.weight.data = full.c_proj.weight.data[:, s * width : (s + 1) * width]
        partial_sum = partial_sum + part(x)
    # float32 sums of 32 terms in a different grouping: a few ulps of values near 1
    torch.testing.assert_close(partial_sum + full.c_proj.bias, full(x), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(10)
def test_residual_projections_are_scaled_by_depth():
    model = GPT(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=128)
    proj_std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    # 65k samples estimate a std to well under 2 %; the two targets differ by a factor 4
    assert proj_std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert fc_std == pytest.approx(0.02, rel=0.05)


@pytest.mark.timeout(10)
def test_weight_decay_applies_only_to_matrices():
    model = GPT(**TINY, weight_decay=0.3)
    decay, no_decay = model.configure_optimizers().param_groups
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.timeout(10)
def test_warmup_ramps_learning_rate_linearly():
    model = GPT(**TINY, lr=1.0, warmup_steps=4)
    config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def _rank_perplexity(rank, world_size, losses, tokens):
    model = GPT(**TINY)
    for loss, n in zip(losses[rank], tokens[rank]):
        model.val_loss_mean.update(torch.tensor(loss), weight=n)
    return torch.exp(model.val_loss_mean.compute()).item()


@pytest.mark.timeout(30)
def test_validation_perplexity_is_exp_of_token_weighted_mean_over_all_ranks():
    # rank 1 sees no batch at all, as a non-last pipeline stage would
    losses, tokens = [[2.0, 3.0], []], [[64, 192], []]
    expected = math.exp((2.0 * 64 + 3.0 * 192) / 256)
    assert run_distributed(_rank_perplexity, 2, losses, tokens) == pytest.approx([expected] * 2)
    losses, tokens = [[2.0], [4.0]], [[100], [300]]
    expected = math.exp((2.0 * 100 + 4.0 * 300) / 400)
    assert run_distributed(_rank_perplexity, 2, losses, tokens) == pytest.approx([expected] * 2)


@pytest.mark.timeout(10)
def test_default_corpus_is_stdlib_python_sources_sorted_without_site_packages():
    files = text_files(None)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and f.is_relative_to(stdlib) for f in files)
    assert not any("site-packages" in f.parts for f in files)


def _datamodule(path, **kwargs):
    dm = TextDataModule(path=str(path), **kwargs)
    dm.setup("fit")
    return dm


@pytest.fixture
def corpus(tmp_path):
    text = bytes(range(256)) * 20  # 5120 bytes, every byte value's position is known
    (tmp_path / "a.txt").write_bytes(text[:3000])
    (tmp_path / "b.txt").write_bytes(text[3000:])
    return tmp_path, text


@pytest.mark.timeout(10)
def test_folder_is_read_as_its_files_concatenated_in_name_order(corpus):
    folder, text = corpus
    dm = _datamodule(folder, val_fraction=0.25, block_size=8)
    assert bytes(torch.cat([dm.train_set.data, dm.val_set.data]).tolist()) == text


@pytest.mark.timeout(10)
def test_max_bytes_caps_the_corpus(corpus):
    folder, text = corpus
    dm = _datamodule(folder, val_fraction=0.5, block_size=8, max_bytes=4000)
    assert len(dm.train_set.data) + len(dm.val_set.data) == 4000


@pytest.mark.timeout(10)
def test_validation_is_the_tail_and_never_trained_on(corpus):
    folder, text = corpus
    dm = _datamodule(folder, val_fraction=0.25, block_size=8, train_samples=500)
    split = len(text) - int(len(text) * 0.25)
    assert bytes(dm.val_set.data.tolist()) == text[split:]
    for i in range(len(dm.train_set)):
        o = int(dm.train_set.offsets[i])
        assert o + 8 + 1 <= split


@pytest.mark.timeout(10)
def test_target_is_the_input_shifted_by_one_byte(corpus):
    folder, text = corpus
    dm = _datamodule(folder, block_size=8)
    for dataset in (dm.train_set, dm.val_set):
        for i in (0, 3, len(dataset) - 1):
            x, y = dataset[i]
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
            assert torch.equal(x[1:], y[:-1])
            # the corpus counts 0..255 repeatedly, so every next byte is the previous + 1
            assert torch.equal(y, (x + 1) % 256)


@pytest.mark.timeout(10)
def test_train_item_depends_only_on_index_and_seed(corpus):
    folder, _ = corpus
    a, b = _datamodule(folder, seed=1), _datamodule(folder, seed=1)
    c = _datamodule(folder, seed=2)
    for i in (0, 7, 99):
        assert torch.equal(a.train_set[i][0], b.train_set[i][0])
    assert not all(torch.equal(a.train_set[i][0], c.train_set[i][0]) for i in range(10))


@pytest.mark.timeout(10)
def test_validation_windows_are_contiguous_and_capped(corpus):
    folder, _ = corpus
    dm = _datamodule(folder, val_fraction=0.5, block_size=8, val_samples=10)
    assert len(dm.val_set) == 10
    first, second = dm.val_set[0][0], dm.val_set[1][0]
    assert torch.equal(torch.cat([first, second]), dm.val_set.data[:16].long())
    uncapped = _datamodule(folder, val_fraction=0.5, block_size=8, val_samples=10**6)
    assert len(uncapped.val_set) == (len(uncapped.val_set.data) - 1) // 8


@pytest.mark.timeout(10)
def test_train_batches_have_equal_size(corpus):
    folder, _ = corpus
    dm = _datamodule(folder, block_size=8, batch_size=7, train_samples=100)
    assert {x.shape for x, _ in dm.train_dataloader()} == {(7, 8)}


@pytest.mark.timeout(10)
def test_too_little_text_is_rejected_with_the_remedy(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="smaller block_size"):
        _datamodule(tmp_path, block_size=64, val_fraction=0.1)


@pytest.mark.timeout(10)
def test_replicas_together_read_the_single_process_order_and_resume_skips_the_first_pass_only():
    from lightning_parallel.data.text import ResumingSampler

    data = list(range(24))
    single = list(ResumingSampler(data))
    assert single == data  # the windows are already random: no reshuffling
    replicas = [list(ResumingSampler(data, num_replicas=2, rank=r)) for r in (0, 1)]
    assert sorted(replicas[0][:3] + replicas[1][:3]) == single[:6]  # first batch of 3 per replica
    resumed = ResumingSampler(data, num_replicas=2, rank=1, skip=3)
    assert list(resumed) == replicas[1][3:]
    assert list(resumed) == replicas[1]  # the next epoch is whole again


@pytest.mark.timeout(10)
def test_checkpoint_monitor_follows_the_logged_validation_metric():
    from lightning_parallel.cli.auto_monitor import pick_monitor

    assert pick_monitor(["train_loss", "val_acc", "val_loss"]) == "val_loss"
    assert pick_monitor(["train_mse", "val_mse", "val_r2"]) == "val_mse"
    assert pick_monitor(["train_loss"]) is None
