import multiprocessing
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The second tier: the longest runs, each tens of seconds on 2 cores: commands and scripts in fresh
# processes (lp-train, lp-plan, refusals as a user sees them, spawn and popen launches), SLURM jobs, the
# 8-process layout, ranks and replica groups killed mid-run, torch.compile, the zoo sample. `python -m pytest -q` leaves them out; `python -m pytest
# -q -m slow` runs them, and CI runs both tiers. A file path marks every test in it.
SECOND_TIER = frozenset({
    "tests/cluster/test_slurm.py",
    "tests/cli/test_cli.py",
    "tests/cli/test_own_module.py",
    "tests/cli/test_finetune.py",
    "tests/checks/test_errors.py",
    "tests/checkpoint/test_checkpoint_atomic.py",
    "tests/models/test_zoo_sample.py",
    "tests/strategy/test_3d.py",
    "tests/strategy/test_lost_rank.py",
    "tests/fault_tolerance/test_replica_groups.py",
    "tests/strategy/test_meta_init.py::test_per_rank_peak_memory_falls_with_tp_times_pp",
    "tests/strategy/test_workflows.py::test_fit_then_test_under_spawn_evaluates_the_trained_weights",
    "tests/strategy/test_workflows.py::test_fit_then_every_entry_point_under_popen_reuses_the_split_model",
    "tests/cli/test_train.py::test_lp_train_with_two_data_parallel_processes_shares_one_run_folder",
    "tests/tensor_parallel/test_tp_wrappers.py::test_tp2_torch_compiled_hf_model_matches_single_process",
    "tests/checkpoint/test_one_device_load.py::test_reader_is_extended_when_lightning_is_imported_after_the_package",
    "tests/fabric/test_litgpt_entry.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SECOND_TIER or item.nodeid.split("[")[0] in SECOND_TIER or item.location[0] in SECOND_TIER:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After a test fails (a timeout included), end the processes it started and left running: they hold
    the rendezvous port every later test of this session uses (Lightning picks it once per process)."""
    outcome = yield
    if outcome.get_result().when == "call" and outcome.get_result().failed:
        for child in multiprocessing.active_children():
            child.kill()
