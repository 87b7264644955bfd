"""The zoo: every causal-LM architecture of the installed transformers at TP=2, PP=2 and TP=4.

For each architecture (``zoo_models``) at one shape (``zoo_models.SHAPES``): build a tiny model, train
it on one process through a plain Lightning ``Trainer`` (the reference), then train the same initial
weights on the same batches with ``TensorParallelStrategy(tensor_parallel=2)``,
``PipelineParallelStrategy(pipeline_parallel=2)`` and ``TensorParallelStrategy(tensor_parallel=4)``
(2 or 4 fork-started gloo processes each) and compare, step for step, every rank's loss and the final
full parameters (TP shards gathered, PP stages united) with the reference. Outcomes:

- ``parity``: losses within ``LOSS_TOL`` and parameters within ``PARAM_TOL``.
- ``parity in float64``: the float32 run was off, and the same run in float64 (reference too) is
  within the tolerances: float32 rounding drifted, as it does for DP=2 on such a model.
- ``refused: <first line>``: an error raised before training started (during set-up).
- ``crash: <first line>``: an error raised, or a process lost, once training had started.
- ``wrong: <largest differences>``: the run finished but does not match, in float32 and in float64.
- ``random: <why>``: the training forward draws random numbers (``zoo_random``) in a way the split
  run cannot reproduce (draws on split activations or on micro-batches): not compared.
- ``hang``: no result within ``--timeout`` seconds; the process group is killed.

A model whose training forward draws random numbers is run with every draw seeded by where it is
made (``zoo_random.KeyedDraws``), in the reference and the split runs alike, so draws on replicated
activations are identical and the comparison stands.

Tolerances (float32, CPU, 3 AdamW steps at lr 1e-3): sharding and micro-batching only reorder
sums, and Adam's 1/sqrt(v) can amplify that rounding on near-zero gradients (see
``tests/test_3d.py``). Measured over the 254 runs at parity of one full zoo run: losses (~4.9) within
1.9e-6, parameters within 2.5e-5 (the embedding of gemma3_text), median 1e-6. A replicated
weight whose gradient is not reduced, a shard on the wrong rank or a tied weight not summed is off
by about the learning rate: the wrong runs of the same zoo run were off by 4.8e-3 to 5.2e-3 in
parameters (and 1.5e-5 to 2.5e-5 in loss, as the culprit weights were small ones).
``LOSS_TOL = 1e-5`` and ``PARAM_TOL = 1e-4`` sit between the two; in float64 the same tolerances
leave rounding (~1e-15) far below and a wrong split (~1e-3) far above.

Each run also records the parameters every rank holds: the share on the largest rank (of the whole
model's) says how much memory the split gives back.

Each architecture runs in its own forked process group (a crash, an OOM kill or a hang cannot take
the harness with it); results go to a JSON file per shape after each run, so a long run can be read
while it goes and resumed.

    python benchmarks/zoo.py --shape gqa3               # every architecture at one shape
    python benchmarks/zoo.py --shape mqa --random 20    # 20 architectures drawn at random
    python benchmarks/zoo.py --only llama,gpt2 --modes tp2
    python benchmarks/zoo.py --sample                   # the fixed sample of tests/models/test_zoo_sample.py
    python benchmarks/zoo.py --shape base --resume      # skip architectures already in the file
    python benchmarks/zoo.py --report                   # rewrite docs/zoo.md from the files, run nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import glob
import json
import multiprocessing as mp
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import nullcontext
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
    SHAPES,
    ZooLM,
    architectures,
    meta_parameter_count,
    tiny_config,
    token_batches,
)
from zoo_random import KeyedDraws  # noqa: E402
from zoo_report import (  # noqa: E402
    is_done,
    new_results,
    save,
    summary_line,
    totals,
    totals_text,
    write_report,
)

from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy  # noqa: E402
from lightning_parallel.tensor_parallel import gather_full_tensor  # noqa: E402

LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
STEPS, BATCH = 3, 4
MODES = ("tp2", "pp2", "tp4")
SAMPLE_MODES = ("tp8",)  # 8 processes: run on a sample (--modes tp8 --only/--random), not in the default report
RUN_MODES = MODES + SAMPLE_MODES
DEVICES = {"tp2": 2, "pp2": 2, "tp4": 4, "tp8": 8}
TIMEOUT_S = 300.0  # falcon_h1 (Mamba layers, reference kernels) needs ~85 s at TP=2 on 2 busy cores
# a spread of styles: fused and split QKV, grouped KV heads, MoE, Conv1D, tied heads, learned
# positions, parallel blocks, and architectures without a base_model_tp_plan
SAMPLE = ("llama", "qwen3", "phi3", "gpt_neox", "gpt2", "opt", "mixtral", "bloom")
ROOT = Path(__file__).resolve().parent.parent


# ---- one fit, recorded on every rank ---------------------------------------------------------------
class Record(Callback):
    """Per rank: a marker once training starts, the parameters it holds, each step's loss, whether the
    training forward drew random numbers, then the full parameters."""

    def __init__(self, out_dir: str, draws: Optional[KeyedDraws] = None):
        self.out_dir, self.draws = out_dir, draws
        self.losses, self.drew, self.held = [], False, 0
        self._rng: Optional[torch.Tensor] = None

    def on_train_start(self, trainer, pl_module):
        Path(self.out_dir, f"started{trainer.global_rank}").touch()
        self.held = sum(p.numel() for p in pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.draws is not None:
            self.draws.start_step(batch_idx, pl_module)
        self._rng = torch.get_rng_state()

    def on_before_backward(self, trainer, pl_module, loss):
        self.drew |= not torch.equal(self._rng, torch.get_rng_state())

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
        checked = getattr(trainer.strategy, "split_verification", None)
        torch.save({"losses": self.losses, "params": params, "sharded": sharded, "held": self.held,
                    "drew": self.drew, "draws": self.draws.summary() if self.draws is not None else None,
                    "verified": vars(checked) if checked is not None else None},
                   Path(self.out_dir, f"rank{trainer.global_rank}.pt"))


def fit(module: L.LightningModule, out_dir: str, vocab: int, strategy: Any = None, devices: int = 1,
        draws: Optional[KeyedDraws] = None) -> list[dict]:
    """Train ``module`` (unchanged) for ``STEPS`` steps; return each rank's record."""
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy or "auto", max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Record(out_dir, draws)],
        # dp = 1 in every run here: each rank reads every batch, in order
        use_distributed_sampler=False,
    )
    with draws if draws is not None else nullcontext():
        trainer.fit(module, DataLoader(token_batches(STEPS, BATCH, vocab), batch_size=BATCH))
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
    whole = sum(p.numel() for p in reference["params"].values())
    detail = {"loss": loss_diff, "param": param_diff, "worst_param": worst,
              "sharded": max(r.get("sharded", 0) for r in records),
              "per_rank": [len(r["params"]) for r in records],
              "share": max(r.get("held", whole) for r in records) / whole,
              "verified": records[0].get("verified")}
    if loss_diff <= LOSS_TOL and param_diff <= PARAM_TOL:
        return "parity", detail
    return f"wrong: loss {loss_diff:.1e}, param {param_diff:.1e} ({worst})", detail


def strategy_for(mode: str):
    if mode in ("tp2", "tp4", "tp8"):
        return TensorParallelStrategy(tensor_parallel=DEVICES[mode], start_method="fork")
    if mode == "pp2":
        return PipelineParallelStrategy(pipeline_parallel=2, start_method="fork")
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _parallel_fit(module, mode: str, work: str, vocab: int, draws: Optional[KeyedDraws]) -> tuple[Optional[list], str]:
    """Each rank's record, or None and the outcome of a run that failed."""
    out_dir = tempfile.mkdtemp(dir=work, prefix=mode)
    try:
        return fit(module, out_dir, vocab, strategy_for(mode), DEVICES[mode], draws), ""
    except BaseException as err:  # noqa: BLE001 - any failure is an outcome
        print(f"---- {mode} failed:\n{err}", file=sys.stderr, flush=True)
        started = bool(glob.glob(os.path.join(out_dir, "started*")))
        return None, f"{'crash' if started else 'refused'}: {error_line(str(err) or repr(err))}"


def in_float64(module: L.LightningModule) -> L.LightningModule:
    """A float64 copy of ``module``; Hugging Face mixture-of-experts layers compute with their plain loop
    (``experts_implementation="eager"``, the same products), as the grouped matrix product has no float64
    kernel."""
    module = copy.deepcopy(module).double()
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_experts_implementation", None) is not None:
            config._experts_implementation = "eager"
    return module


def run_mode(module: L.LightningModule, reference: dict, mode: str, work: str, vocab: int,
             draws: Optional[KeyedDraws] = None, reference64: Any = None) -> dict:
    """One parallel run of ``module`` against ``reference``: the outcome and its details. A wrong
    float32 run is repeated in float64 (``reference64()`` gives the float64 reference), where
    rounding no longer hides or fakes a difference."""
    records, failure = _parallel_fit(copy.deepcopy(module), mode, work, vocab, draws)
    if records is None:
        return {"outcome": failure}
    outcome, detail = compare(reference, records)
    unmatched = draws.unmatched(records) if draws is not None else None
    if unmatched:
        return {"outcome": f"random: {unmatched}", **detail}
    if outcome == "parity" or reference64 is None:
        return {"outcome": outcome, **detail}
    records64, failure = _parallel_fit(in_float64(module), mode, work, vocab, draws)
    if records64 is None:
        return {"outcome": f"{outcome}; float64 {failure}", **detail}
    outcome64, detail64 = compare(reference64(), records64)
    float32 = f"float32: loss {detail['loss']:.1e}, param {detail['param']:.1e}"
    if outcome64 == "parity":
        return {"outcome": f"parity in float64 ({float32})", **detail64, "float32": detail}
    return {"outcome": f"{outcome64} in float64 ({float32})", **detail64, "float32": detail}


# ---- one architecture, in its own process group ----------------------------------------------------
def reference_run(arch: str, shape: str, work: str) -> tuple[Optional[L.LightningModule], Optional[dict], dict]:
    """Build the tiny model and train it on one process: (module, record, result fields)."""
    try:
        config = tiny_config(arch, SHAPES[shape])
        n_params = meta_parameter_count(config)
        if n_params > MAX_PARAMS:
            return None, None, {"one_process": f"skipped: {n_params:,} parameters (the config ignored the tiny sizes)"}
        L.seed_everything(0, verbose=False)
        module = ZooLM(config)
        record = fit(copy.deepcopy(module), tempfile.mkdtemp(dir=work, prefix="ref"), SHAPES[shape].vocab)[0]
    except BaseException as err:  # noqa: BLE001 - an architecture the generic config cannot train
        traceback.print_exc()
        return None, None, {"one_process": f"fails: {error_line(traceback.format_exc() or str(err))}"}
    if not all(torch.isfinite(torch.tensor(record["losses"]))):
        return None, None, {"one_process": f"fails: non-finite loss {record['losses']}"}
    return module, record, {"one_process": "trains", "params": n_params, "drew": record["drew"],
                            "losses": [round(x, 6) for x in record["losses"]]}


def architecture_worker(arch: str, shape: str, modes: list[str], conn, log_dir: Path) -> None:
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
    vocab = SHAPES[shape].vocab
    try:
        start = time.time()
        module, reference, fields = reference_run(arch, shape, work)
        draws = None
        if module is not None and reference["drew"]:  # again, with every draw seeded by where it is made
            draws = KeyedDraws(module)
            reference = fit(copy.deepcopy(module), tempfile.mkdtemp(dir=work, prefix="ref"), vocab, draws=draws)[0]
            draws.freeze(reference)
            fields["draws"] = reference["draws"]
        conn.send(("fields", {**fields, "seconds_one_process": round(time.time() - start, 1)}))
        if module is None:
            return
        cache: dict = {}

        def reference64() -> dict:  # the float64 reference, made once, when a run needs it
            if "record" not in cache:
                out = tempfile.mkdtemp(dir=work, prefix="ref64")
                cache["record"] = fit(in_float64(module), out, vocab, draws=draws)[0]
            return cache["record"]

        for mode in modes:
            conn.send(("start", mode))
            start = time.time()
            try:
                result = run_mode(module, reference, mode, work, vocab, draws, reference64)
            except Exception:  # noqa: BLE001 - a bug of the harness is an outcome too, never a silent gap
                traceback.print_exc()
                result = {"outcome": f"crash: in the zoo harness: {error_line(traceback.format_exc())}"}
            conn.send(("fields", {mode: result["outcome"], f"{mode}_detail": result,
                                  f"seconds_{mode}": round(time.time() - start, 1)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        conn.send(("done", None))
        conn.close()


class Running:
    """The harness's view of one architecture's process: which run it is in, since when."""

    def __init__(self, arch: str, shape: str, modes: list[str], ctx, log_dir: Path):
        self.arch, self.modes = arch, list(modes)
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=architecture_worker, args=(arch, shape, self.modes, child, log_dir))
        self.proc.start()
        child.close()
        self.current: Optional[str] = "one_process"
        self.since = time.time()

    def failure(self, timeout: float) -> Optional[str]:
        """The outcome of the current run if it hung (past ``timeout``) or its process died."""
        one_process = self.current not in RUN_MODES
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


def run_zoo(archs: list[str], out: Path, shape: str = "base", modes: tuple[str, ...] = MODES, jobs: int = 1,
            timeout: float = TIMEOUT_S, results: Optional[dict] = None, log=print) -> dict:
    """Run ``archs`` at ``shape`` (``jobs`` at a time) and write ``out`` after every result; return
    the results. Each architecture's output (warnings, tracebacks) goes to ``logs/<shape>/<arch>.log``
    beside ``out``. After a hang or a lost process the architecture's remaining runs start in a fresh
    process."""
    ctx = mp.get_context("fork")
    results = results if results is not None else new_results(shape, settings())
    results["meta"]["timeout_s"] = timeout
    queue = [(a, list(modes)) for a in archs]
    running: list[Running] = []
    try:
        _drive(queue, running, results, out, shape, jobs, timeout, ctx, log)
    finally:  # interrupted: the architectures' process groups do not outlive the harness
        for run in running:
            run.kill()
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    save(results, out)
    return results


def settings() -> dict:
    return {"steps": STEPS, "batch": BATCH, "loss_tol": LOSS_TOL, "param_tol": PARAM_TOL, "timeout_s": TIMEOUT_S}


def _drive(queue: list, running: list, results: dict, out: Path, shape: str, jobs: int, timeout: float, ctx,
           log) -> None:
    """The harness loop: start architectures, read their messages, kill the ones past ``timeout``."""
    while queue or running:
        while queue and len(running) < jobs:
            arch, modes = queue.pop(0)
            running.append(Running(arch, shape, modes, ctx, out.parent / "logs" / shape))
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
                if run.current in RUN_MODES:
                    entry[f"seconds_{run.current}"] = round(time.time() - run.since, 1)
                run.modes = [m for m in run.modes if m != run.current] if run.current in RUN_MODES else []
                save(results, out)
                if run.modes:
                    queue.insert(0, (run.arch, run.modes))
            if finished or failure is not None:
                running.remove(run)
                log(f"{run.arch:28s} {summary_line(entry, [m for m in RUN_MODES if m in entry])}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/zoo"), help="folder of the results (<shape>.json)")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "zoo.md")
    parser.add_argument("--shape", default="base", choices=sorted(SHAPES))
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(RUN_MODES)}")
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--sample", action="store_true", help=f"the fixed sample: {', '.join(SAMPLE)}")
    parser.add_argument("--random", type=int, help="N architectures drawn at random (see --seed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --random draw")
    parser.add_argument("--resume", action="store_true", help="keep the shape's results, skip finished architectures")
    parser.add_argument("--jobs", type=int, default=1, help="architectures at a time (each uses 2-4 processes)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per run before it counts as a hang")
    parser.add_argument("--report", action="store_true", help="only rewrite --doc from the results in --out")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_zoo's clean-up runs
    modes = tuple(args.modes.split(","))
    if set(modes) - set(RUN_MODES):
        parser.error(f"--modes: one of {', '.join(RUN_MODES)}")
    out = args.out / f"{args.shape}.json"
    if not args.report:
        results = json.loads(out.read_text()) if args.resume and out.exists() else new_results(args.shape, settings())
        known = architectures()
        archs = args.only.split(",") if args.only else list(SAMPLE) if args.sample else known
        unknown = sorted(set(archs) - set(known))
        if unknown:
            parser.error(f"not causal-LM model types here: {', '.join(unknown)}")
        if args.random:
            archs = sorted(random.Random(args.seed).sample(archs, min(args.random, len(archs))))
            results["meta"]["drawn"] = {"count": len(archs), "seed": args.seed}
        if args.resume:
            archs = [a for a in archs if not is_done(results["architectures"].get(a, {}), modes)]
        print(f"{len(archs)} architectures at shape {args.shape}, {args.jobs} at a time, results in {out}", flush=True)
        results = run_zoo(archs, out, args.shape, modes, args.jobs, args.timeout, results,
                          log=lambda s: print(s, flush=True))
        shown = MODES + tuple(m for m in SAMPLE_MODES if m in modes)
        print(totals_text(totals(results, shown), shown))
    if args.report or not (args.only or args.sample):
        every = {shape: json.loads((args.out / f"{shape}.json").read_text())
                 for shape in SHAPES if (args.out / f"{shape}.json").exists()}
        write_report(every, args.doc, MODES)
        print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
