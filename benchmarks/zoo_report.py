"""The zoo's results files (one per shape) and the page they make, ``docs/zoo.md``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch
from zoo_models import SHAPES

KINDS = ("parity", "refused", "crash", "wrong", "random", "hang")
CELL = 200  # characters of an outcome shown in a table cell (the results file keeps 300)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def new_results(shape: str, settings: dict) -> dict:
    import transformers

    meta = {"started": now(), "transformers": transformers.__version__, "torch": torch.__version__,
            "lightning": L.__version__, "shape": shape, **settings}
    return {"meta": meta, "architectures": {}}


def save(results: dict, out: Path) -> None:
    results["meta"]["updated"] = now()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(out)  # readers never see half a file


def is_done(entry: dict, modes) -> bool:
    return entry.get("one_process", "").startswith(("fails", "skipped")) or all(m in entry for m in modes)


def kind(outcome: str) -> str:
    """``parity``, ``refused``, ... of an outcome text (``parity in float64 (...)`` is parity)."""
    return outcome.split(":")[0].split(" ")[0]


def summary_line(entry: dict, modes) -> str:
    return " | ".join(f"{k}: {entry.get(k, '-')}" for k in ("one_process", *modes))


def totals(results: dict, modes) -> dict:
    entries = results["architectures"].values()
    trains = [e for e in entries if e.get("one_process") == "trains"]
    out = {"architectures": len(results["architectures"]), "train_one_process": len(trains),
           "draw": sum(bool(e.get("drew")) for e in trains)}
    for mode in modes:
        ran = [e for e in trains if mode in e]
        out[f"{mode}_ran"] = len(ran)
        for k in KINDS:
            out[f"{mode}_{k}"] = sum(kind(e[mode]) == k for e in ran)
        out[f"{mode}_float64"] = sum(e[mode].startswith("parity in float64") for e in ran)
    return out


def totals_text(t: dict, modes) -> str:
    lines = [f"{t['architectures']} causal-LM architectures; {t['train_one_process']} train on one process "
             f"from the generic tiny config ({t['draw']} of them draw random numbers in their training forward)."]
    for mode in modes:
        n = t[f"{mode}_ran"]
        if not n:
            continue
        parts = [f"{k} {t[f'{mode}_{k}']} ({100 * t[f'{mode}_{k}'] / n:.0f}%)" for k in KINDS]
        float64 = f" [{t[f'{mode}_float64']} of the parity runs in float64 only]" if t[f"{mode}_float64"] else ""
        lines.append(f"{mode_name(mode)}: " + ", ".join(parts) + float64)
    return "\n".join(lines)


def mode_name(mode: str) -> str:
    return {"tp2": "TP=2", "pp2": "PP=2", "tp4": "TP=4", "tp8": "TP=8"}.get(mode, mode)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sci(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def outcome_cell(entry: dict, mode: str) -> str:
    """The outcome, with the share of the parameters the largest rank holds when it reached parity."""
    outcome, detail = entry.get(mode, "-"), entry.get(f"{mode}_detail", {})
    if kind(outcome) != "parity" or "share" not in detail:
        return outcome if len(outcome) <= CELL else outcome[: CELL - 3] + "..."
    return f"{outcome} ({100 * detail['share']:.0f}% on the largest rank)"


def _section(results: dict, modes) -> str:
    meta, t = results["meta"], totals(results, modes)
    shape = SHAPES[meta["shape"]]
    drawn = meta.get("drawn")
    which = (f"{drawn['count']} architectures drawn at random (seed {drawn['seed']})" if drawn else
             "every architecture")
    ran = [m for m in modes if t[f"{m}_ran"]]
    rows = []
    for arch, e in sorted(results["architectures"].items()):
        one = e.get("one_process", "-")
        one = f"trains ({e['params']:,} params{', draws' if e.get('drew') else ''})" if one == "trains" else one
        one = one if len(one) <= CELL else one[: CELL - 3] + "..."
        rows.append(f"| {arch} | {cell(one)} | " + " | ".join(cell(outcome_cell(e, m)) for m in ran) + " |")
    header = "| architecture | one process | " + " | ".join(mode_name(m) for m in ran) + " |"
    return f"""## Shape `{shape.name}`: {shape.describe()}

{which}; run started {meta['started']}, last result {meta['updated']}.

```
{totals_text(t, modes)}
```

{header}
|{'---|' * (len(ran) + 2)}
""" + "\n".join(rows) + "\n"


def write_report(every: dict[str, dict], path: Path, modes) -> str:
    """``docs/zoo.md``: how the zoo is run, then the totals and one row per architecture of each shape."""
    if not every:
        raise ValueError("no results to report")
    meta = next(iter(every.values()))["meta"]
    text = f"""# The zoo: Hugging Face causal LMs at TP=2, PP=2 and TP=4, at several shapes

Generated by `python benchmarks/zoo.py` (transformers {meta['transformers']}, torch {meta['torch']},
lightning {meta['lightning']}).

Every architecture in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from one generic tiny config per
shape (below; no per-model tuning, no download) inside an unchanged LightningModule whose loss is the
model's own (`labels=`), and trained {meta['steps']} AdamW steps (float32, batch {meta['batch']} x 16
tokens) on one process. Those that train are then run through
`Trainer(strategy=TensorParallelStrategy(tensor_parallel=2))`,
`Trainer(strategy=PipelineParallelStrategy(pipeline_parallel=2))` and
`Trainer(strategy=TensorParallelStrategy(tensor_parallel=4))` on 2 or 4 fork-started gloo processes,
and every rank's loss and the final full parameters are compared step for step with the one-process
run (loss within {sci(meta['loss_tol'])}, parameters within {sci(meta['param_tol'])}; the reasoning is
in the docstring of `benchmarks/zoo.py`). A run off in float32 is repeated in float64, reference
included: `parity in float64` means float32 rounding drifted (as it does for DP=2 on such a model),
`wrong ... in float64` that the split computes something else.

    python benchmarks/zoo.py --shape gqa3        # every architecture at one shape, rewrites this page
    python benchmarks/zoo.py --shape mqa --random 20 --modes tp2,pp2   # a random draw of 20
    python benchmarks/zoo.py --only opt          # one architecture; tracebacks in /tmp/zoo/logs/base/opt.log
    python -m pytest tests/models/test_zoo_sample.py   # the fixed sample, about a minute

Outcomes: `parity` (with the share of the model's parameters the largest rank holds: how much
memory the split gives back); `refused: <reason>` (an error at set-up, before training: the strategy
says what it does not support, and why); `crash: <error>` (after training started);
`wrong: <differences>`; `random: <why>` (the training forward draws random numbers the split run
cannot draw alike, see below); `hang` (no result in {meta['timeout_s']:g} s). One-process failures
(`fails`, `skipped`) come from the generic config, not from parallelism, and are left out of the
percentages.

Models whose training forward draws random numbers (marked `draws`: a sampling router, router noise,
a dropout the config names in its own way) are trained with every draw seeded by where it is made
(the step, the module, the operator: `benchmarks/zoo_random.py`), on one process and split alike, so
draws on replicated activations match and the runs compare step for step. A draw on a split
activation (one rank's heads, one micro-batch) cannot match; such a run is reported as `random`,
never as parity or wrong.

""" + "\n".join(_section(results, modes) for _, results in sorted(every.items(), key=lambda kv: list(SHAPES).index(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text
