"""Fine-tuning a pretrained model: time to the first step and peak host memory per rank, reading each
rank's shards on the meta device (ours) against building the whole model on every rank and splitting it.

    python benchmarks/pretrained.py [--layers 8] [--hidden 1024] [--repeats 3] [--tp 2]

Saves a Llama of the given size with ``save_pretrained`` to a temporary folder, then fits one step of
a plain LightningModule that calls ``from_pretrained`` in ``__init__``, at TP=--tp on CPU processes
(fork), built two ways: plainly (every rank reads the whole file into memory, then splits it) and
under ``trainer.init_module(empty_init=True)`` (every rank reads only its shards). Each run is a fresh
process; per rank it records the seconds from the Trainer's start to the first training batch, the
peak resident memory up to then (``VmHWM``), and the safetensors bytes it read. Prints the median over
repeats of the worst rank, ours beside the peer, as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = r'''
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
start = time.perf_counter()
import lightning as L, torch, transformers
from lightning_parallel import ParallelStrategy
from lightning_parallel.checkpoint import pretrained
transformers.logging.set_verbosity_error()
folder, mode, tp, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

class FineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

def peak_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024

class Measure(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:
            with open(f"{out}.{trainer.global_rank}", "w") as f:
                json.dump({"seconds": time.perf_counter() - start, "peak_mb": peak_mb(),
                           "read_mb": pretrained.BYTES_READ[0] / 2**20}, f)

trainer = L.Trainer(accelerator="cpu", devices=tp, max_steps=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()],
                    strategy=ParallelStrategy(tensor_parallel=tp, start_method="fork"))
if mode == "meta":
    with trainer.init_module(empty_init=True):
        module = FineTune()
else:
    module = FineTune()
data = torch.randint(0, 1000, (4, 32))
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
'''


def save_model(folder: Path, layers: int, hidden: int) -> float:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 64, tie_word_embeddings=False)
    with torch.device("meta"):
        size = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return size * 4 / 2**20


def run(folder: Path, mode: str, tp: int, scratch: Path) -> dict:
    out = scratch / f"{mode}-{time.time_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", RUN, str(folder), mode, str(tp), str(out)], check=True, env=env,
                   capture_output=True, timeout=1800)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(tp)]
    worst = {key: max(r[key] for r in ranks) for key in ranks[0]}
    if mode == "plain":  # transformers reads the whole file on every rank (memory-mapped, not counted here)
        worst["read_mb"] = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        size = save_model(scratch / "model", args.layers, args.hidden)
        results = {"plain": [], "meta": []}
        for _ in range(args.repeats):  # alternate, so a slower stretch of the machine hits both
            for mode in results:
                results[mode].append(run(scratch / "model", mode, args.tp, scratch))
    median = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()}
    print(f"Llama {args.layers} layers x {args.hidden}, {size:.0f} MB in float32, TP={args.tp} on CPU processes; "
          f"median of {args.repeats} runs, the worst rank of each")
    print(f"{'':24}{'meta, shard reads (ours)':>26}{'whole, then split':>20}{'ratio':>8}")
    for key, label in (("seconds", "time to first step (s)"), ("peak_mb", "peak host memory (MB)"),
                       ("read_mb", "safetensors read (MB)")):
        ours, peer = median["meta"][key], median["plain"][key]
        ratio = f"{ours / peer:.2f}x"
        print(f"{label:24}{ours:>26.1f}{peer:>20.1f}{ratio:>8}")


if __name__ == "__main__":
    main()
