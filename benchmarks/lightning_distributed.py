"""Lightning's own distributed tests of its weight-averaging callbacks, with each of our strategies in place of ``ddp``.

Lightning tests ``WeightAveraging`` / ``EMAWeightAveraging`` (``tests_pytorch/callbacks/test_weight_averaging.py``)
and ``StochasticWeightAveraging`` (``test_stochastic_weight_avg.py``) under ``strategy="ddp_spawn"`` (and
``"ddp"`` on GPUs). This script runs those files with pytest once per strategy: Lightning's own (the
peer), then each of ours swapped in wherever a test asks for ``"ddp_spawn"`` or ``"ddp"``, with the same
``devices``: ``DataParallelStrategy`` at ZeRO stages 0-3, ``TensorParallelStrategy``,
``PipelineParallelStrategy``. Ours start their processes by fork (Lightning's multiprocessing launcher,
as ``ddp_spawn`` uses, without re-importing torch in each child). It prints, per strategy, the tests
passed, failed and skipped and the seconds taken, then every failure with the first line of its error;
``docs/testing.md`` says which DDP specific each remaining failure asserts.

Lightning's test files are not installed with it: pass the ``tests`` folder of a Lightning checkout at
the installed version (``git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning``,
then ``--lightning-tests pytorch-lightning/tests``). By default only the tests whose name says ``ddp``
run (the others run on one device and do not reach our strategies); ``--select ''`` runs every test of
the two files.

Run: ``python benchmarks/lightning_distributed.py --lightning-tests DIR [--strategies dp_zero3 ...] [--select ddp]``.
The same file is the pytest plugin that swaps the strategy in (``-p benchmarks.lightning_distributed``,
reading ``LP_SWAPPED_STRATEGY``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
ENV = "LP_SWAPPED_STRATEGY"
TEST_FILES = ["tests_pytorch/callbacks/test_weight_averaging.py", "tests_pytorch/callbacks/test_stochastic_weight_avg.py"]
SWAPPED = ("ddp_spawn", "ddp")


def strategies() -> dict[str, Callable[[], Any]]:
    """Name -> factory of the strategy put in place of ``ddp_spawn`` / ``ddp``."""
    from lightning_parallel import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    made: dict[str, Callable[[], Any]] = {
        f"dp_zero{stage}": (lambda stage=stage: DataParallelStrategy(zero_stage=stage, start_method="fork"))
        for stage in range(4)
    }
    made["tp"] = lambda: TensorParallelStrategy(start_method="fork")
    made["pp"] = lambda: PipelineParallelStrategy(start_method="fork")
    return made


# ---- the pytest plugin (in the pytest process) ------------------------------------------------
def pytest_configure(config: Any) -> None:
    """Make every ``Trainer(strategy="ddp_spawn" | "ddp")`` use the strategy ``LP_SWAPPED_STRATEGY`` names."""
    name = os.environ.get(ENV, "lightning")
    if name == "lightning":
        return
    from lightning.pytorch import Trainer

    make = strategies()[name]
    original = Trainer.__init__

    def init(self: Any, *args: Any, strategy: Any = "auto", **kwargs: Any) -> None:
        original(self, *args, strategy=make() if strategy in SWAPPED else strategy, **kwargs)

    Trainer.__init__ = init


# ---- the runner ---------------------------------------------------------------------------------
def run_tests(tests: Path, name: str, select: str, report: Path) -> float:
    env = dict(os.environ, **{ENV: name})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(tests), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.lightning_distributed",
               f"--junitxml={report}", "--rootdir", str(tests), *TEST_FILES]
    if select:
        command += ["-k", select]
    start = time.monotonic()
    # a session of its own: Lightning's test session ends by signalling its process group
    subprocess.run(command, cwd=tests, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                   start_new_session=True)
    return time.monotonic() - start


def outcomes(report: Path) -> list[tuple[str, str, str]]:
    """``(test, outcome, first line of its error)`` of each test case in a JUnit report."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if problem is None else ("skipped" if problem.tag == "skipped" else "failed")
        message = "" if problem is None else (problem.get("message") or "").strip().splitlines()[:1]
        rows.append((case.get("name", "?"), outcome, message[0] if message else ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning-tests", type=Path, required=True,
                        help="the tests folder of a Lightning checkout (it holds tests_pytorch/)")
    parser.add_argument("--strategies", nargs="+", default=["lightning", *strategies()],
                        help="'lightning' (its own ddp_spawn/ddp) and any of: " + ", ".join(strategies()))
    parser.add_argument("--select", default="ddp", help="pytest -k expression ('' for every test of the files)")
    args = parser.parse_args()
    tests = args.lightning_tests.resolve()
    missing = [f for f in TEST_FILES if not (tests / f).is_file()]
    if missing:
        sys.exit(f"{tests} lacks {', '.join(missing)}: pass the tests folder of a Lightning checkout")
    failures = []
    print(f"{'strategy':<10} {'passed':>6} {'failed':>6} {'skipped':>7} {'seconds':>8}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.strategies:
            report = Path(scratch) / f"{name}.xml"
            seconds = run_tests(tests, name, args.select, report)
            rows = outcomes(report) if report.is_file() else [("(pytest did not report)", "failed", "")]
            count = {k: sum(1 for _, o, _ in rows if o == k) for k in ("passed", "failed", "skipped")}
            print(f"{name:<10} {count['passed']:>6} {count['failed']:>6} {count['skipped']:>7} {seconds:>8.0f}",
                  flush=True)
            failures += [(name, test, message) for test, outcome, message in rows if outcome == "failed"]
    for name, test, message in failures:
        print(f"FAILED {name}: {test}: {message[:300]}")


if __name__ == "__main__":
    main()
