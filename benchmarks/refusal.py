"""How long a refusal of a tiny model takes, and what it prints besides.

For a script: a 4-head BERT classifier (Hugging Face, two blocks) inside a plain LightningModule,
``Trainer(devices=3, strategy=ParallelStrategy(tensor_parallel=2))`` and ``tensor_parallel=3``:
the time from ``trainer.fit`` to the refusal (every check, and every suggestion tried), and the
whole script from the interpreter's start, beside the bare imports it needs (torch, Lightning,
transformers), which bound it from below. For `lp-train`: the fine-tuning recipe on a tiny saved
Llama at ``strategy.tensor_parallel=3``, the whole command, and how often the model's own loading
messages ("Loading weights", the load report) are printed. Medians of ``--repeats`` runs.

Run: ``python benchmarks/refusal.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import sys, time, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification
from lightning_parallel.strategy import ParallelStrategy

class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.bert = BertForSequenceClassification(BertConfig(
            vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=32, num_labels=3))
    def training_step(self, batch, i):
        return self.bert(input_ids=batch[0], labels=batch[1]).loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

data = TensorDataset(torch.randint(0, 256, (16, 16)), torch.randint(0, 3, (16,)))
trainer = L.Trainer(accelerator="cpu", devices=3, max_steps=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    strategy=ParallelStrategy(tensor_parallel=int(sys.argv[1])))
start = time.perf_counter()
try:
    trainer.fit(Classifier(), DataLoader(data, batch_size=4))
except ValueError:
    print(f"REFUSED_IN {time.perf_counter() - start:.3f}")
"""


def timed(command: list[str], cwd: str) -> tuple[float, str]:
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start, run.stdout + run.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "script.py"
        script.write_text(SCRIPT)
        sys.path.insert(0, str(Path(__file__).parents[1]))
        from tests.helpers.pretrained import save_tiny_llama

        llama = save_tiny_llama(Path(folder) / "llama", vocab=256)
        imports = [timed([sys.executable, "-c", "import torch, lightning, transformers"], folder)[0]
                   for _ in range(repeats)]
        print(f"imports (torch, lightning, transformers): {statistics.median(imports):.1f} s")
        for tp in (2, 3):
            runs = [timed([sys.executable, str(script), str(tp)], folder) for _ in range(repeats)]
            checks = [float(out.split("REFUSED_IN ")[1].split()[0]) for _, out in runs]
            print(f"script, devices=3 tensor_parallel={tp}: refused {statistics.median(checks):.2f} s after fit(); "
                  f"{statistics.median(t for t, _ in runs):.1f} s from the interpreter's start")
        runs = [timed(["lp-train", "+recipe=finetune_cpu", f"model.pretrained={llama}", "strategy.tensor_parallel=3"],
                      folder) for _ in range(repeats)]
        loads = runs[0][1].count("Loading weights") + runs[0][1].count("LOAD REPORT")
        print(f"lp-train finetune_cpu tensor_parallel=3: {statistics.median(t for t, _ in runs):.1f} s, "
              f"loading messages printed {loads} time(s)")


if __name__ == "__main__":
    main()
