"""Suite-wide settings and markers. Every test under ``tests/integration/`` (and the README's
own commands, ``tests/test_readme_commands.py``) starts processes and is marked
``integration``; ``tests/unit/`` starts none (the planner worker of the adaptive loop aside:
it is the loop's own process). ``slow``: a single test that takes 20 s or more on 2 cores.
``alone``: a test that starts processes and reads timings (rates, detection, a throttled
link): ``scripts/test.sh`` runs it with the cores to itself. ``patient``: a test of
:data:`PATIENT_FILES` (deaths, deadlines, restarts), run two files at a time after the shared
pass.
Every integration test is ``alone`` unless its file is in :data:`SHARE_CORES` (it checks values:
losses, parameters, files, messages) or :data:`PATIENT_FILES`, so a new test runs alone until
someone says it need not.

    pytest -n 2 tests/unit                 # the fast part while working (about 1.5 min on 2 cores)
    pytest -m "not slow"                   # everything but the slowest tests
    bash scripts/test.sh                   # everything (CI)
"""
import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_HERE = Path(__file__).resolve().parent
_INTEGRATION = (_HERE / "integration", _HERE / "test_readme_commands.py")


#: integration test files whose tests may share the cores with another test (they check values,
#: never timings): scripts/test.sh runs them beside tests/unit, a worker more than the cores
SHARE_CORES = frozenset({
    "test_checkpoint_cli.py", "test_checkpoint_disk_full.py", "test_data_text_engines.py",
    "test_data_tokens_engines.py",
    "test_deepspeed_checkpoint_import.py", "test_deepspeed_equivalence.py",
    "test_deepspeed_fp16_formats.py", "test_deepspeed_universal_export.py",
    "test_deepspeed_user_checkpoint.py", "test_dp_four_ranks.py", "test_dp_initialize.py",
    "test_dp_resplit.py", "test_gpu_check.py", "test_group_lifetime.py", "test_hf_equivalence.py",
    "test_hf_roundtrip.py", "test_hf_trainer.py", "test_malleus_checkpoint.py",
    "test_malleus_cli.py", "test_malleus_equivalence.py", "test_malleus_errors.py",
    "test_malleus_precision.py", "test_malleus_schedulers.py", "test_malleus_switch.py",
    "test_p2p_order.py", "test_pack_warmup.py", "test_planner_imports.py", "test_step_collectives.py",
    "test_poisoned_checkpoints.py", "test_readme_commands.py", "test_stream_logs.py",
    "test_summarize_cli.py", "test_third_party_ds_configs.py", "test_train_cli.py",
    "test_train_launch.py", "test_transformers_import.py",
})
#: tests of those files that read timings all the same (the demo's straggler must be re-planned;
#: a multirun job's what-if reads its healthy steps' timings; the straggler's summary its phases;
#: the Trainer's slowed rank must be re-split)
ALONE_TESTS = frozenset({"test_demo_twin_compares_deepspeed_and_malleus",
                         "test_multirun_launches_ranks_per_job",
                         "test_torchrun_two_ranks_writes_metrics_with_straggler",
                         "test_a_slowed_rank_gets_fewer_samples_and_the_trainer_stays_stocks"})


#: integration test files that wait on deaths, deadlines and restarts but read no rates
#: (marked ``patient``, not ``alone``): their bounds hold on a loaded machine (the watchdog's
#: hang timeout, the switch agreement's deadline, the campaign's budgets: all 25 passed twice
#: beside a full load). scripts/test.sh runs them after the shared pass, two files at a time:
#: beside the shared pass they moved as much CPU into it as they saved (bench/RESULTS.md,
#: session 33)
PATIENT_FILES = frozenset({
    "test_elastic_nodes.py", "test_chaos.py", "test_migration_failures.py", "test_guards.py",
    "test_restart_parts.py", "test_watchdog.py", "test_harness.py", "test_launcher_watch.py",
    "test_checkpoint_write_kill.py", "test_cpu_compete.py",
})
#: what the shared pass starts first: pytest-xdist (--dist loadfile) hands out whole files in
#: collection order, so the longest file goes first and never runs alone at the end
FIRST_FILES = ("test_readme_commands.py",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        p = Path(str(item.fspath)).resolve()
        if any(p == q or q in p.parents for q in _INTEGRATION):
            item.add_marker(pytest.mark.integration)
            if p.name in PATIENT_FILES:
                item.add_marker(pytest.mark.patient)
            elif p.name not in SHARE_CORES or item.originalname in ALONE_TESTS:
                item.add_marker(pytest.mark.alone)
    items.sort(key=lambda it: Path(str(it.fspath)).name not in FIRST_FILES)   # stable
