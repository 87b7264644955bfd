"""Peak host memory of ``lp-export`` against the size of the model and of its largest tensor.

A Llama-style model (92M parameters, float32: 367 MB; largest tensors the 32000 x 768 embedding and
head, 98 MB each) is saved with ``save_pretrained``, loaded by a LightningModule with
``from_pretrained``, trained one step at TP=2 x PP=2 (4 fork-started CPU processes, SGD at lr 0)
and checkpointed as a DCP directory. Each measurement then runs in a fresh process and reports its
peak resident set (``VmHWM``) minus that of a process that only imports the same modules:

- ``lp-export`` of the directory (one 367 MB safetensors file; then 100 MB shards);
- ``lp-export`` of ``lp-consolidate``'s plain file (memory-mapped: pages it touched count as resident);
- for comparison, what exporting takes without it: consolidate, load into the module, ``save_pretrained``.

Run: ``python benchmarks/export_memory.py`` (about two minutes on 2 CPU cores; ~3 GB of memory).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.strategy import ParallelStrategy

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
              num_key_value_heads=12, max_position_embeddings=64, tie_word_embeddings=False)
IMPORTS = "import sys, transformers, peft, safetensors; from lightning_parallel.cli.export import main; "
# the high-water mark of this process's own memory (``ru_maxrss`` would start at the launching process's)
PEAK = "; print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))"


class FineTune(L.LightningModule):
    def __init__(self, folder: str):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def peak_bytes(code: str) -> int:
    """Peak resident bytes of a fresh Python process running ``code`` after the common imports."""
    out = subprocess.run([sys.executable, "-c", IMPORTS + code + PEAK], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(root / "pretrained")
        del model
        started = time.time()
        trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False,
                            strategy=ParallelStrategy(tensor_parallel=2, pipeline_parallel=2, micro_batches=2,
                                                      start_method="fork", timeout=300),
                            callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1)])
        data = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
        trainer.fit(FineTune(str(root / "pretrained")), DataLoader(TensorDataset(data), batch_size=2))
        checkpoint = root / "ckpt" / "epoch=0-step=1.ckpt"
        print(f"model {total / 1e6:.0f} MB, largest tensor {largest / 1e6:.0f} MB; fit and save at TP2 x PP2: "
              f"{time.time() - started:.0f} s")
        subprocess.run([sys.executable, "-m", "lightning_parallel.checkpoint.consolidate", str(checkpoint),
                        str(root / "plain.ckpt")], check=True, capture_output=True)
        base = peak_bytes("pass")
        runs = {
            "lp-export DCP directory": f"main([{str(checkpoint)!r}, {str(root / 'a')!r}])",
            "lp-export DCP directory, --max-shard-size 100MB": (
                f"main([{str(checkpoint)!r}, {str(root / 'b')!r}, '--max-shard-size', '100MB'])"),
            "lp-export plain .ckpt (lp-consolidate's)": f"main([{str(root / 'plain.ckpt')!r}, {str(root / 'c')!r}])",
            "consolidate + load_state_dict + save_pretrained": (
                "from lightning_parallel.checkpoint import consolidate; import pathlib; "
                f"s = consolidate(pathlib.Path({str(checkpoint)!r}))['state_dict']; "
                f"m = transformers.AutoModelForCausalLM.from_pretrained({str(root / 'pretrained')!r}); "
                "m.load_state_dict({k[len('model.'):]: v for k, v in s.items()}); "
                f"m.save_pretrained({str(root / 'd')!r})"),
        }
        print(f"imports alone: {base / 1e6:.0f} MB resident")
        for name, code in runs.items():
            started = time.time()
            extra = peak_bytes(code) - base
            print(f"{name}: peak +{extra / 1e6:.0f} MB over the imports ({extra / largest:.1f} x largest tensor, "
                  f"{extra / total:.2f} x model), {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
