"""The zoo: every causal-LM architecture of the installed transformers at TP=2 and at PP=2.

For each architecture (``zoo_models``): build a tiny model, train it on one process through a plain
Lightning ``Trainer`` (the reference), then train the same initial weights on the same batches with
``TensorParallelStrategy(tensor_parallel=2)`` and with ``PipelineParallelStrategy(pipeline_parallel=2)``
(2 fork-started gloo processes each) and compare, step for step, every rank's loss and the final
full parameters (TP shards gathered, PP stages united) with the reference. Outcomes:

- ``parity``: losses within ``LOSS_TOL`` and parameters within ``PARAM_TOL``.
- ``refused: <first line>``: an error raised before training started (during set-up).
- ``crash: <first line>``: an error raised, or a process lost, once training had started.
- ``wrong: <largest differences>``: the run finished but does not match.
- ``hang``: no result within ``--timeout`` seconds; the process group is killed.

Tolerances (float32, CPU, 3 AdamW steps at lr 1e-3): sharding and micro-batching only reorder
sums, and Adam's 1/sqrt(v) can amplify that rounding on near-zero gradients (see
``tests/test_3d.py``). Measured over the 254 runs at parity of one full zoo run: losses (~4.9) within
1.9e-6, parameters within 2.5e-5 (the embedding of gemma3_text), median 1e-6. A replicated
weight whose gradient is not reduced, a shard on the wrong rank or a tied weight not summed is off
by about the learning rate: the wrong runs of the same zoo run were off by 4.8e-3 to 5.2e-3 in
parameters (and 1.5e-5 to 2.5e-5 in loss, as the culprit weights were small ones).
``LOSS_TOL = 1e-5`` and ``PARAM_TOL = 1e-4`` sit between the two.

Each architecture runs in its own forked process group (a crash, an OOM kill or a hang cannot take
the harness with it); results go to a JSON file after each run, so a long run can be read while it
goes and resumed.

    python benchmarks/zoo.py                       # everything, results in /tmp/zoo/results.json
    python benchmarks/zoo.py --only llama,gpt2     # a few architectures
    python benchmarks/zoo.py --sample              # the fixed sample of tests/test_zoo_sample.py
    python benchmarks/zoo.py --resume              # skip architectures already in the file
    python benchmarks/zoo.py --report              # rewrite docs/zoo.md from the file, run nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import glob
import json
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import (  # noqa: E402
    MAX_PARAMS,
    ZooLM,
    architectures,
    meta_parameter_count,
    tiny_config,
    token_batches,
)

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy  # noqa: E402
from lightning_parallel.tensor_parallel import gather_full_tensor  # noqa: E402

LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
STEPS, BATCH = 3, 4
MODES = ("tp2", "pp2")
TIMEOUT_S = 300.0  # falcon_h1 (Mamba layers, reference kernels) needs ~85 s at TP=2 on 2 busy cores
# a spread of styles: fused and split QKV, grouped KV heads, MoE, Conv1D, tied heads, learned
# positions, parallel blocks, and architectures without a base_model_tp_plan
SAMPLE = ("llama", "qwen3", "phi3", "gpt_neox", "gpt2", "opt", "mixtral", "bloom")
ROOT = Path(__file__).resolve().parent.parent


# ---- one fit, recorded on every rank ---------------------------------------------------------------
class Record(Callback):
    """Per rank: a marker once training starts, each step's loss, then the full parameters."""

    def __init__(self, out_dir: str):
        self.out_dir, self.losses = out_dir, []

    def on_train_start(self, trainer, pl_module):
        Path(self.out_dir, f"started{trainer.global_rank}").touch()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module):
        mesh = getattr(trainer.strategy, "mesh", None)
        params, sharded = {}, 0
        for name, p in pl_module.named_parameters():
            shard = getattr(p, "tp_shard", None)
            params[name] = gather_full_tensor(p, shard, mesh) if shard is not None else p.detach().clone()
            sharded += shard is not None
        torch.save({"losses": self.losses, "params": params, "sharded": sharded},
                   Path(self.out_dir, f"rank{trainer.global_rank}.pt"))


def fit(module: L.LightningModule, out_dir: str, strategy: Any = None) -> list[dict]:
    """Train ``module`` (unchanged) for ``STEPS`` steps; return each rank's record."""
    devices = 2 if strategy is not None else 1
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy or "auto", max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Record(out_dir)],
        # dp = 1 in every run here: each rank reads every batch, in order
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(token_batches(STEPS, BATCH), batch_size=BATCH))
    return [torch.load(Path(out_dir, f"rank{r}.pt")) for r in range(devices)]


def error_line(text: str) -> str:
    """The first line of the last exception in a formatted traceback (or of any message)."""
    lines = text.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    for line in lines[frames[-1] + 1 if frames else 0:]:
        if line.strip() and not line.startswith(" "):
            return line.strip()[:300]
    return (lines[-1].strip() if lines else "no message")[:300]


def compare(reference: dict, records: list[dict]) -> tuple[str, dict]:
    """``parity`` or ``wrong: ...``, and the largest differences."""
    loss_diff = 0.0
    for record in records:
        if len(record["losses"]) != len(reference["losses"]):
            return f"wrong: {len(record['losses'])} steps instead of {len(reference['losses'])}", {}
        diffs = torch.tensor(record["losses"]) - torch.tensor(reference["losses"])
        loss_diff = max(loss_diff, float(diffs.abs().max().nan_to_num(float("inf"))))
    params: dict[str, torch.Tensor] = {}
    for record in records:  # PP: the union of the stages (a tied weight held by both is equal)
        for name, value in record["params"].items():
            params.setdefault(name, value)
    missing = sorted(set(reference["params"]) - set(params))
    if missing:
        return f"wrong: parameters on no rank: {', '.join(missing[:3])}", {"loss": loss_diff}
    param_diff, worst = 0.0, ""
    for name, expected in reference["params"].items():
        got = params[name]
        diff = float((got - expected).abs().max().nan_to_num(float("inf"))) if got.shape == expected.shape else float("inf")
        if diff > param_diff:
            param_diff, worst = diff, name
    detail = {"loss": loss_diff, "param": param_diff, "worst_param": worst,
              "sharded": max(r["sharded"] for r in records),
              "per_rank": [len(r["params"]) for r in records]}
    if loss_diff <= LOSS_TOL and param_diff <= PARAM_TOL:
        return "parity", detail
    return f"wrong: loss {loss_diff:.1e}, param {param_diff:.1e} ({worst})", detail


def strategy_for(mode: str):
    if mode == "tp2":
        return TensorParallelStrategy(tensor_parallel=2, start_method="fork")
    if mode == "pp2":
        return PipelineParallelStrategy(pipeline_parallel=2, start_method="fork")
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def run_mode(module: L.LightningModule, reference: dict, mode: str, work: str) -> dict:
    """One parallel run of ``module`` against ``reference``: the outcome and its details."""
    out_dir = tempfile.mkdtemp(dir=work, prefix=mode)
    try:
        records = fit(module, out_dir, strategy_for(mode))
    except BaseException as err:  # noqa: BLE001 - any failure is an outcome
        print(f"---- {mode} failed:\n{err}", file=sys.stderr, flush=True)
        started = bool(glob.glob(os.path.join(out_dir, "started*")))
        return {"outcome": f"{'crash' if started else 'refused'}: {error_line(str(err) or repr(err))}"}
    outcome, detail = compare(reference, records)
    return {"outcome": outcome, **detail}


# ---- one architecture, in its own process group ----------------------------------------------------
def reference_run(arch: str, work: str) -> tuple[Optional[L.LightningModule], Optional[dict], dict]:
    """Build the tiny model and train it on one process: (module, record, result fields)."""
    try:
        config = tiny_config(arch)
        n_params = meta_parameter_count(config)
        if n_params > MAX_PARAMS:
            return None, None, {"one_process": f"skipped: {n_params:,} parameters (the config ignored the tiny sizes)"}
        L.seed_everything(0, verbose=False)
        module = ZooLM(config)
        record = fit(copy.deepcopy(module), tempfile.mkdtemp(dir=work, prefix="ref"))[0]
    except BaseException as err:  # noqa: BLE001 - an architecture the generic config cannot train
        traceback.print_exc()
        return None, None, {"one_process": f"fails: {error_line(traceback.format_exc() or str(err))}"}
    if not all(torch.isfinite(torch.tensor(record["losses"]))):
        return None, None, {"one_process": f"fails: non-finite loss {record['losses']}"}
    return module, record, {"one_process": "trains", "params": n_params,
                            "losses": [round(x, 6) for x in record["losses"]]}


def architecture_worker(arch: str, modes: list[str], conn, log_dir: Path) -> None:
    """Entry of the forked per-architecture process: sends ("fields", {...}), ("start", mode) and
    ("done", None) to the harness; its output goes to ``log_dir/<arch>.log``."""
    os.setsid()  # its own process group: the harness kills it with everything it started
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{arch}.log", "a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    work = tempfile.mkdtemp(prefix=f"zoo-{arch}-")
    try:
        start = time.time()
        module, reference, fields = reference_run(arch, work)
        conn.send(("fields", {**fields, "seconds_one_process": round(time.time() - start, 1)}))
        if module is None:
            return
        for mode in modes:
            conn.send(("start", mode))
            start = time.time()
            result = run_mode(copy.deepcopy(module), reference, mode, work)
            conn.send(("fields", {mode: result["outcome"], f"{mode}_detail": result,
                                  f"seconds_{mode}": round(time.time() - start, 1)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        conn.send(("done", None))
        conn.close()


class Running:
    """The harness's view of one architecture's process: which run it is in, since when."""

    def __init__(self, arch: str, modes: list[str], ctx, log_dir: Path):
        self.arch, self.modes = arch, list(modes)
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=architecture_worker, args=(arch, self.modes, child, log_dir))
        self.proc.start()
        child.close()
        self.current: Optional[str] = "one_process"
        self.since = time.time()

    def failure(self, timeout: float) -> Optional[str]:
        """The outcome of the current run if it hung (past ``timeout``) or its process died."""
        one_process = self.current not in MODES
        if self.proc.is_alive() and time.time() - self.since > timeout:
            return f"fails: no result in {timeout:.0f} s" if one_process else "hang"
        if not self.proc.is_alive() and not self.conn.poll():
            code = self.proc.exitcode
            return f"fails: exit code {code}" if one_process else f"crash: process exited with code {code}"
        return None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.join(5)


def run_zoo(archs: list[str], out: Path, jobs: int = 1, timeout: float = TIMEOUT_S,
            results: Optional[dict] = None, log=print) -> dict:
    """Run ``archs`` (``jobs`` at a time) and write ``out`` after every result; return the results.

    Each architecture's output (warnings, tracebacks) goes to ``logs/<arch>.log`` beside ``out``.
    After a hang or a lost process the architecture's remaining runs start in a fresh process."""
    ctx = mp.get_context("fork")
    results = results if results is not None else new_results()
    results["meta"]["timeout_s"] = timeout
    queue = [(a, list(MODES)) for a in archs]
    running: list[Running] = []
    try:
        _drive(queue, running, results, out, jobs, timeout, ctx, log)
    finally:  # interrupted: the architectures' process groups do not outlive the harness
        for run in running:
            run.kill()
    results["meta"]["finished"] = now()
    save(results, out)
    return results


def _drive(queue: list, running: list, results: dict, out: Path, jobs: int, timeout: float, ctx, log) -> None:
    """The harness loop: start architectures, read their messages, kill the ones past ``timeout``."""
    while queue or running:
        while queue and len(running) < jobs:
            arch, modes = queue.pop(0)
            running.append(Running(arch, modes, ctx, out.parent / "logs"))
        wait([r.conn for r in running], timeout=1.0)
        for run in list(running):
            entry = results["architectures"].setdefault(run.arch, {})
            finished = False
            while not finished and run.conn.poll():
                try:
                    kind, value = run.conn.recv()
                except EOFError:
                    break
                if kind == "fields":
                    entry.update(value)
                    run.modes = [m for m in run.modes if m not in value]
                    if entry.get("one_process") != "trains":
                        run.modes = []
                    save(results, out)
                elif kind == "start":
                    run.current, run.since = value, time.time()
                elif kind == "done":
                    finished = True
                    run.proc.join(10)
            failure = None if finished else run.failure(timeout)
            if failure is not None:
                run.kill()
                entry[run.current] = failure
                if run.current in MODES:
                    entry[f"seconds_{run.current}"] = round(time.time() - run.since, 1)
                run.modes = [m for m in run.modes if m != run.current] if run.current in MODES else []
                save(results, out)
                if run.modes:
                    queue.insert(0, (run.arch, run.modes))
            if finished or failure is not None:
                running.remove(run)
                log(f"{run.arch:28s} {summary_line(entry)}")


# ---- results file and report -----------------------------------------------------------------------
def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def new_results() -> dict:
    import transformers

    meta = {"started": now(), "transformers": transformers.__version__, "torch": torch.__version__,
            "lightning": L.__version__, "steps": STEPS, "batch": BATCH, "loss_tol": LOSS_TOL,
            "param_tol": PARAM_TOL, "timeout_s": TIMEOUT_S}
    return {"meta": meta, "architectures": {}}


def save(results: dict, out: Path) -> None:
    results["meta"]["updated"] = now()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(out)  # readers never see half a file


def is_done(entry: dict) -> bool:
    return entry.get("one_process", "").startswith(("fails", "skipped")) or all(m in entry for m in MODES)


def summary_line(entry: dict) -> str:
    return " | ".join(f"{k}: {entry.get(k, '-')}" for k in ("one_process", *MODES))


def totals(results: dict) -> dict:
    entries = results["architectures"].values()
    trains = [e for e in entries if e.get("one_process") == "trains"]
    out = {"architectures": len(results["architectures"]), "train_one_process": len(trains)}
    for mode in MODES:
        for kind in ("parity", "refused", "crash", "wrong", "hang"):
            out[f"{mode}_{kind}"] = sum(e.get(mode, "").split(":")[0] == kind for e in trains)
    out["both_parity"] = sum(e.get("tp2") == "parity" and e.get("pp2") == "parity" for e in trains)
    return out


def totals_text(t: dict) -> str:
    n = t["train_one_process"] or 1

    def pct(k: str) -> str:
        return f"{t[k]} ({100 * t[k] / n:.0f}%)"

    lines = [f"{t['architectures']} causal-LM architectures; {t['train_one_process']} train on one process "
             "from the generic tiny config."]
    for mode, name in (("tp2", "TP=2"), ("pp2", "PP=2")):
        lines.append(f"{name}: parity {pct(mode + '_parity')}, refused {pct(mode + '_refused')}, "
                     f"crash {pct(mode + '_crash')}, wrong {pct(mode + '_wrong')}, hang {pct(mode + '_hang')}")
    lines.append(f"parity at both TP=2 and PP=2: {pct('both_parity')}")
    return "\n".join(lines)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sci(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def outcome_cell(entry: dict, mode: str) -> str:
    """The outcome, with how the parallel run split the model when it reached parity."""
    outcome, detail = entry.get(mode, "-"), entry.get(f"{mode}_detail", {})
    if outcome != "parity":
        return outcome
    if mode == "tp2":
        return f"parity ({detail['sharded']} tensors sharded)"
    return f"parity ({' + '.join(map(str, detail['per_rank']))} tensors per stage)"


def write_report(results: dict, path: Path) -> str:
    """``docs/zoo.md``: how the zoo is run, the totals and one row per architecture."""
    meta, t = results["meta"], totals(results)
    rows = []
    for arch, e in sorted(results["architectures"].items()):
        one = e.get("one_process", "-")
        one = f"trains ({e['params']:,} params)" if one == "trains" else one
        rows.append(f"| {arch} | {cell(one)} | {cell(outcome_cell(e, 'tp2'))} | {cell(outcome_cell(e, 'pp2'))} |")
    text = f"""# The zoo: Hugging Face causal LMs at TP=2 and PP=2

Generated by `python benchmarks/zoo.py` (transformers {meta['transformers']}, torch {meta['torch']},
lightning {meta['lightning']}; run started {meta['started']}, last result {meta['updated']}).

Every architecture in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from one generic tiny config
(2 blocks, hidden 64, 4 heads, 2 KV heads, vocab 128, dropout 0, untied head; no per-model tuning,
no download) inside an unchanged LightningModule whose loss is the model's own (`labels=`), and
trained {meta['steps']} AdamW steps (float32, batch {meta['batch']} x 16 tokens) on one process.
Those that train are then run through `Trainer(strategy=TensorParallelStrategy(tensor_parallel=2))`
and `Trainer(strategy=PipelineParallelStrategy(pipeline_parallel=2))` on 2 fork-started gloo
processes, and every rank's loss and the final full parameters are compared step for step with the
one-process run (loss within {sci(meta['loss_tol'])}, parameters within {sci(meta['param_tol'])}; the
reasoning is in the docstring of `benchmarks/zoo.py`).

    python benchmarks/zoo.py            # the whole zoo (~25 min on 2 busy cores), rewrites this page
    python benchmarks/zoo.py --only opt # one architecture; tracebacks in /tmp/zoo/logs/opt.log
    python -m pytest tests/test_zoo_sample.py   # the fixed sample of 8, about a minute

Outcomes: `parity`; `refused: <reason>` (an error at set-up, before training: the strategy says
what it does not support); `crash: <error>` (after training started); `wrong: <differences>`;
`hang` (no result in {meta['timeout_s']:g} s). One-process failures (`fails`, `skipped`) come
from the generic config, not from parallelism, and are left out of the percentages.

## Totals

```
{totals_text(t)}
```

## Architectures

| architecture | one process | TP=2 | PP=2 |
|---|---|---|---|
""" + "\n".join(rows) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/zoo/results.json"))
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "zoo.md")
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--sample", action="store_true", help=f"the fixed sample: {', '.join(SAMPLE)}")
    parser.add_argument("--limit", type=int, help="the first N architectures only")
    parser.add_argument("--resume", action="store_true", help="keep --out's results, skip finished architectures")
    parser.add_argument("--jobs", type=int, default=1, help="architectures at a time (each uses 2 processes)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per run before it counts as a hang")
    parser.add_argument("--report", action="store_true", help="only rewrite --doc from --out")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_zoo's clean-up runs

    results = json.loads(args.out.read_text()) if (args.resume or args.report) and args.out.exists() else new_results()
    if not args.report:
        known = architectures()
        archs = args.only.split(",") if args.only else list(SAMPLE) if args.sample else known
        unknown = sorted(set(archs) - set(known))
        if unknown:
            parser.error(f"not causal-LM model types here: {', '.join(unknown)}")
        if args.resume:
            archs = [a for a in archs if not is_done(results["architectures"].get(a, {}))]
        archs = archs[: args.limit] if args.limit else archs
        print(f"{len(archs)} architectures, {args.jobs} at a time, results in {args.out}", flush=True)
        results = run_zoo(archs, args.out, args.jobs, args.timeout, results,
                          log=lambda s: print(s, flush=True))
    if not (args.only or args.sample or args.limit):
        write_report(results, args.doc)
        print(f"wrote {args.doc}")
    print(totals_text(totals(results)))


if __name__ == "__main__":
    main()
