"""The CPU recipes on a real SLURM cluster: sbatch, two nodes, the submitit launcher, refusals,
preemption, and tasks killed on one node.

CI brings up a two-node SLURM on this machine with `.ci/local_slurm.sh up` (a slurmd per node).
Elsewhere these tests skip when no SLURM answers; with CI=true a missing SLURM fails them instead.
Every wait is bounded (a training job by ``JOB_TIMEOUT`` s, 300 unless ``LP_SLURM_JOB_TIMEOUT``
says more, for a machine shared with other work), and a job still running at its deadline is
cancelled, so a hung collective fails the test rather than the CI job.

Losses of a resumed run are compared with the uninterrupted run's at the same steps within 1e-5:
both are the same float32 computation in the same order on the same layout, the checkpoint holds
float32 values exactly, so they agree to within float32 reassociation error, far below the ~0.1 change
one optimizer step or a different batch makes.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

SBATCH_SCRIPT = Path(__file__).parents[2] / "recipes/slurm/train.sbatch"
JOB_TIMEOUT = float(os.environ.get("LP_SLURM_JOB_TIMEOUT", 300))
LOSS_ATOL = 1e-5
# The 3D recipe (TP2 x PP2) on two nodes of two tasks: a TP group inside each node, the pipeline across
# them. 45 steps with a checkpoint every 15, so that a run can be killed between two of them.
TWO_NODES = ("--nodes=2", "--ntasks-per-node=2")
THREE_D_ON_TWO_NODES = ("+recipe=gpt_3d_cpu", "trainer.num_nodes=2", "trainer.devices=2", "trainer.max_steps=45")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def _slurm_unavailable() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "SLURM client commands (sinfo, sbatch) are not installed; run .ci/local_slurm.sh up"
    result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0 or not {"idle", "mixed", "allocated"} & set(result.stdout.split()):
        return f"no SLURM node is up (sinfo: {result.stdout.strip() or result.stderr.strip()}); run .ci/local_slurm.sh up"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _slurm_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the SLURM tests: {reason}")
        pytest.skip(reason)


def job_env() -> dict[str, str]:
    """This environment without the rendezvous variables earlier in-process launches left behind.

    sbatch exports the submitting environment; a stale MASTER_PORT would make every job on the node
    rendezvous on one port, and two concurrent jobs would then join each other's process group.
    """
    stale = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"}
    return {k: v for k, v in os.environ.items() if k not in stale}


def _two_nodes_unavailable() -> str | None:
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30,
                            check=False)
    up = [line for line in result.stdout.splitlines() if line.split()[-1] in ("idle", "mixed", "allocated")]
    if len(up) < 2:
        return f"the two-node tests need two SLURM nodes up (sinfo: {result.stdout.strip()}); run .ci/local_slurm.sh up"
    return None


@pytest.fixture(scope="module")
def two_nodes(slurm):
    reason = _two_nodes_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the two-node SLURM tests: {reason}")
        pytest.skip(reason)


def sbatch(cwd: Path, *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=job_env(), capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def job_state(job: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30, check=False
    )
    return out.stdout.strip()


def wait_for(job: str, timeout: float, states=FINAL_STATES) -> str:
    """Poll until the job reaches one of ``states``; cancel it and fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job)
        if state in states:
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=30, check=False)
    pytest.fail(f"SLURM job {job} was still {job_state(job)!r} after {timeout} s; cancelled")


def release_requeued(job: str) -> None:
    """Wait until ``job`` is back in the queue; SLURM starts it again by itself.

    A requeued job waits until its old credential has expired (``AuthInfo=cred_expire``: 120 s by
    default, 10 s on the local cluster of ``.ci/local_slurm.sh``). An earlier start forced with
    ``scontrol update StartTime=now`` is refused by slurmd ("Job credential revoked") and ends the job
    as FAILED with a run time of 0 s, so the tests do not force one.
    """
    assert wait_for(job, timeout=60, states={"PENDING"} | FINAL_STATES) == "PENDING"


def restarts(job: str) -> int:
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30, check=True)
    return int(re.search(r"Restarts=(\d+)", info.stdout).group(1))


def nodes_of(job: str) -> list[str]:
    hostlist = subprocess.run(["squeue", "-h", "--states=all", "-j", job, "-o", "%N"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
    return subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=30,
                          check=True).stdout.split()


def train_losses(run_dir: Path, version: int = 0) -> list[tuple[int, float]]:
    with open(run_dir / f"logs/version_{version}/metrics.csv") as f:
        # the logger rewrites its header as new metrics appear: early rows may lack train_loss
        return [(int(r["step"]), float(r["train_loss"])) for r in csv.DictReader(f) if r.get("train_loss")]


def check_trained(run_dir: Path, log: str, steps: Optional[int], versions: int = 1) -> None:
    """The run (its ``versions`` log folders, one per start of the job) lowered the loss, saved a last
    checkpoint (at step ``steps`` when given) and was checked by lp-plan before srun."""
    losses = [row for version in range(versions) for row in train_losses(run_dir, version)]
    assert losses[-1][1] < losses[0][1], f"loss did not fall: {losses}"
    last = run_dir / "checkpoints/last.ckpt"
    # a split model (TP or PP) writes a directory of shards whose meta.pt holds the loop state
    meta = last / "meta.pt" if last.is_dir() else last
    assert meta.exists()
    if steps is not None:
        assert torch.load(meta, map_location="cpu", weights_only=False)["global_step"] == steps
    assert "peak per device" in log  # lp-plan checked the layout before srun


@pytest.fixture(scope="module")
def two_node_run(two_nodes, tmp_path_factory):
    """The 3D recipe on two nodes, uninterrupted: (job id, log, run folder, final state)."""
    cwd = tmp_path_factory.mktemp("two_nodes")
    job = sbatch(cwd, *TWO_NODES, str(SBATCH_SCRIPT), *THREE_D_ON_TWO_NODES)
    state = wait_for(job, timeout=JOB_TIMEOUT)
    return job, (cwd / f"lp-train-{job}.out").read_text(), cwd / f"runs/lp-train-{job}", state


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_3d_recipe_trains_across_two_nodes_with_tp_inside_each(two_node_run):
    job, log, run_dir, state = two_node_run
    assert state == "COMPLETED", log[-3000:]
    assert len(nodes_of(job)) == 2
    # lp-plan's map of this allocation: the TP group of each stage on one node, the pipeline across both
    assert re.search(r"rank +1: stage 0 replica 0 shard 1 node 0\n", log), log[:2000]
    assert re.search(r"rank +2: stage 1 replica 0 shard 0 node 1\n", log), log[:2000]
    assert "tp groups: [0, 1] [2, 3]" in log and "pp groups: [0, 2] [1, 3]" in log
    # the four ranks met at the rendezvous on the first node of the allocation
    assert "Initializing distributed: GLOBAL_RANK: 3, MEMBER: 4/4" in log
    check_trained(run_dir, log, steps=45)


@pytest.mark.timeout(3 * JOB_TIMEOUT + 120)
def test_job_whose_tasks_on_one_node_are_killed_is_requeued_and_resumes_with_the_uninterrupted_losses(
    two_node_run, tmp_path
):
    uninterrupted = dict(train_losses(two_node_run[2]))
    job = sbatch(tmp_path, *TWO_NODES, str(SBATCH_SCRIPT), *THREE_D_ON_TWO_NODES)
    run_dir = tmp_path / f"runs/lp-train-{job}"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (run_dir / "checkpoints/last.ckpt").exists():  # training has saved its first checkpoint
        assert time.monotonic() < deadline and job_state(job) in ("PENDING", "RUNNING"), job_state(job)
        time.sleep(0.5)
    # SIGKILL every task on the second node, as the kernel's OOM killer or a crash would: no signal
    # handler runs, no checkpoint is saved; the tasks on the first node are left alone
    second = nodes_of(job)[-1]
    listed = subprocess.run(["scontrol", "listpids", job, second], capture_output=True, text=True, timeout=30,
                            check=True).stdout.splitlines()[1:]
    # the tasks themselves: a task's own children (data-loader workers) have no task id ("-")
    tasks = [int(row.split()[0]) for row in listed
             if row.split()[2] not in ("batch", "extern") and row.split()[3] != "-"]
    assert len(tasks) == 2, listed
    for pid in tasks:
        os.kill(pid, 9)
    # the step fails, the batch script sees a checkpoint saved by this run and requeues the job
    release_requeued(job)
    state = wait_for(job, timeout=JOB_TIMEOUT)
    log = (tmp_path / f"lp-train-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert restarts(job) == 1
    assert f"requeueing job {job}" in log
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints/last.ckpt'}" in log

    # before the kill and after the resume, every logged loss is the uninterrupted run's
    before, after = train_losses(run_dir, version=0), train_losses(run_dir, version=1)
    assert min(step for step, _ in after) in (19, 34), after  # the first step logged after a checkpoint at 15 or 30
    assert max(step for step, _ in after) == 44
    for step, loss in before + after:
        assert loss == pytest.approx(uninterrupted[step], abs=LOSS_ATOL), (step, before, after, uninterrupted)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_mismatched_layout_fails_before_any_rank_starts(two_nodes, tmp_path):
    # 2 x 2 x 2 = 8 processes asked of a 2-node x 2-task allocation
    job = sbatch(tmp_path, *TWO_NODES, str(SBATCH_SCRIPT), "+recipe=gpt_3d_cpu", "trainer.num_nodes=2", "trainer.devices=2",
                 "strategy.data_parallel=2")
    assert wait_for(job, timeout=JOB_TIMEOUT) == "FAILED"
    log = (tmp_path / f"lp-train-{job}.out").read_text()
    assert "needs 8 processes, but the allocation has 2 node(s) x 2 = 4" in log
    # every suggestion has passed the same checks: resubmit for the layout, or fit the layout to the allocation
    assert "trainer.num_nodes=2 trainer.devices=4 strategy.data_parallel=2   (sbatch --nodes=2 --ntasks-per-node=4)" in log
    assert " strategy.data_parallel=1   # keep 2 node(s) x 2 devices" in log
    assert "Initializing distributed" not in log


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_submitit_multirun_sweeps_on_slurm(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [
            "lp-train", "--multirun", "+recipe=[gpt2_cpu_dp2,submitit]", "model.lr=3e-3,1e-3",
            "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        losses = train_losses(sweep / job)
        assert losses[-1][1] < losses[0][1], f"job {job}: loss did not fall: {losses}"
        assert (sweep / job / "checkpoints/last.ckpt").exists()


@pytest.mark.timeout(2 * JOB_TIMEOUT + 120)
def test_preempted_job_checkpoints_and_resumes_where_it_stopped(slurm, tmp_path):
    steps = 120
    job = sbatch(tmp_path, "--ntasks-per-node=2", str(SBATCH_SCRIPT), "+recipe=gpt2_cpu_dp2", f"trainer.max_steps={steps}")
    run_dir = tmp_path / f"runs/lp-train-{job}"
    metrics = run_dir / "logs/version_0/metrics.csv"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (metrics.exists() and train_losses(run_dir)):  # training has begun: handlers are installed
        assert time.monotonic() < deadline and job_state(job) in ("PENDING", "RUNNING"), job_state(job)
        time.sleep(0.5)
    # what `#SBATCH --signal=USR1@120` does before the time limit, now
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    release_requeued(job)
    state = wait_for(job, timeout=JOB_TIMEOUT)
    log = (tmp_path / f"lp-train-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert restarts(job) == 1

    saved = torch.load(run_dir / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 0 < saved < steps
    assert f"Restoring states from the checkpoint path at {run_dir / 'hpc_ckpt_1.ckpt'}" in log
    # the requeued run logs into version_1, from the saved step on, and trains to the end
    resumed = [step for step, _ in train_losses(run_dir, version=1)]
    assert resumed and min(resumed) >= saved, f"resumed run logged steps {resumed}, saved at {saved}"
    assert max(resumed) == steps - 1  # logged every 5 steps, 0-based
    assert log.index(f"`max_steps={steps}` reached") > log.index("Restoring states")
    # the recipe as a whole: a falling loss, a last checkpoint written after the resume (Lightning writes it
    # at each validation: every 15 steps and at the epoch's end, so not necessarily at step 120)
    check_trained(run_dir, log, steps=None, versions=2)
    last = run_dir / "checkpoints/last.ckpt"
    assert saved < torch.load(last, map_location="cpu", weights_only=False)["global_step"] <= steps
