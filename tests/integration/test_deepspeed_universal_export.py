"""The way back (``malleus-export --to deepspeed-universal``, ``export/ds_universal.py``):
engine=malleus for N steps under a non-uniform TP=2 plan, exported as a DeepSpeed universal
checkpoint, continues under stock DeepSpeed in every layout it trains (engine=deepspeed ZeRO-0,
-1 and -2 on 2 ranks; PipelineEngine pp=2 x dp=2 with ZeRO-1) with the losses engine=malleus
gets continuing itself. The processes are shared: one 4-rank run saves engine=malleus's
checkpoint; the exports run here; one 2-rank run continues the ZeRO-0/1/2 exports (an engine
after another) and saves a stock ZeRO-1 checkpoint; one 4-rank run continues the pipeline
export and loads both kinds of universal folder into engine=malleus. The tests read their
results."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.integration.test_deepspeed_checkpoint_import import (
    MODEL, M, N, _initialize_and_load, _other_plan, _run, _save_each)

#: the shared runs take 20 s or more on 2 cores
pytestmark = pytest.mark.slow

#: the layouts stock DeepSpeed continues an export in: id -> (ZeRO stage, pipeline stages)
LAYOUTS = {"zero0": (0, 1), "zero1": (1, 1), "zero2": (2, 1), "pipeline-zero1": (1, 2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """engine=malleus for N+M steps saving at N: its losses, and the step-N save as latest."""
    tmp = tmp_path_factory.mktemp("universal")
    ours = run_distributed(_run, 4, "malleus", 1, N + M, tmp / "ck", False, _other_plan(tmp),
                           None, 1, N, timeout=300)[0]
    shutil.rmtree(tmp / "ck" / f"global_step{N + M}")
    (tmp / "ck" / "latest").write_text(f"global_step{N}")
    return tmp, ours


def _export(src, out):
    """``malleus-export SRC OUT --to deepspeed-universal``: (exit code, what it printed)."""
    from malleus_ds.app.cli import export_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = export_main([str(src), str(out), "--to", "deepspeed-universal"])
    return rc, buf.getvalue()


def _on_two(rank, world, outs, root):
    """Stock DeepSpeed continuing each 2-rank export ({id: folder}); then engine=deepspeed
    ZeRO-1 saving at step N into ``root/zero1`` (its losses over N+M steps)."""
    got = {lid: _run(rank, world, "deepspeed", LAYOUTS[lid][0], N + M, out, True)
           for lid, out in outs.items()}
    return got, _save_each(rank, world, root, {"zero1": (1, None)})["zero1"]


def _on_four(rank, world, pipeline_out, back, uni, plan):
    """Stock PipelineEngine continuing the pipeline export; engine=malleus (an ``initialize``
    user's engine) loading our export (``back``) and DeepSpeed's own universal folder."""
    zero, pp = LAYOUTS["pipeline-zero1"]
    return (_run(rank, world, "deepspeed", zero, N + M, pipeline_out, True, None, None, pp),
            _initialize_and_load(rank, world, back, plan),
            _initialize_and_load(rank, world, uni, plan))


@pytest.fixture(scope="module")
def shared(saved):
    """The exports and the two shared runs: {"export": {id: (exit code, output, folder)},
    "stock": {id: [losses per rank]}, "ds_zero1": (folder, losses), "ds_universal": (folder,
    ds_to_universal's result), "back" / "theirs": [(global_steps, losses) per rank]}."""
    tmp, _ = saved
    out = {"export": {}}
    for lid in list(LAYOUTS) + ["back"]:
        folder = tmp / f"universal_{lid}"
        out["export"][lid] = (*_export(tmp / "ck", folder), folder)
    two = {lid: out["export"][lid][2] for lid, (_, pp) in LAYOUTS.items() if pp == 1}
    got = run_distributed(_on_two, 2, two, tmp / "ds", timeout=900)
    out["stock"] = {lid: [g[0][lid] for g in got] for lid in two}
    out["ds_zero1"] = (tmp / "ds" / "zero1", got[0][1])
    tag = f"global_step{N}"
    uni = tmp / "ds_universal"
    p = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder", str(tmp / "ds" / "zero1" / tag), "--output_folder",
                        str(uni / tag), "--num_extract_workers", "1",
                        "--num_merge_workers", "1", "--inject_missing_state"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = run_distributed(_on_four, 4, out["export"]["pipeline-zero1"][2],
                          out["export"]["back"][2], uni, _other_plan(tmp), timeout=900)
    out["stock"]["pipeline-zero1"] = [g[0] for g in got]
    out["back"] = [g[1] for g in got]
    out["theirs"] = [g[2] for g in got]
    out["ds_universal"] = uni
    return out


@pytest.mark.parametrize("lid", list(LAYOUTS))
def test_stock_deepspeed_continues_an_exported_malleus_checkpoint(saved, shared, lid):
    """ZeRO-1/2 and PipelineEngine through DeepSpeed's universal load (the pipeline under its
    PipelineModule names); ZeRO-0 as a plain save (the model-states file's module and torch
    AdamW state)."""
    _, ours = saved
    rc, printed, out = shared["export"][lid]
    assert rc == 0
    assert "wrote DeepSpeed universal checkpoint" in printed
    tag = out / f"global_step{N}"
    assert (out / "latest_universal").read_text() == tag.name
    assert (tag / "zero" / "blocks.0.attn.wq.weight" / "exp_avg.pt").is_file()
    rec = json.loads((tag / "run.json").read_text())
    assert rec["engine"] == "deepspeed" and rec["universal"] is True and rec["step"] == N
    assert (tag / "zero" / "1.layer.attn.wq.weight" / "exp_avg.pt").is_file()
    got = shared["stock"][lid]
    assert len(got) == 2 * LAYOUTS[lid][1]
    for r, losses in enumerate(got):
        np.testing.assert_allclose(losses, ours[N:], rtol=2e-5, err_msg=f"rank {r}")


def test_layouts_deepspeed_cannot_continue_are_refused_before_training(saved):
    """ZeRO-0 with a pipeline, or in fp16/bf16 (DeepSpeed's universal load leaves those to
    optimizer files the format has no room for): a config error naming what to use."""
    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.run_config import ConfigError
    from malleus_ds.app.runners import deepspeed_runner
    from malleus_ds.app.cli import export_main

    tmp, _ = saved
    out = tmp / "refused"
    assert export_main([str(tmp / "ck"), str(out), "--to", "deepspeed-universal"]) == 0
    for par, prec in (({"tp": 1, "pp": 2, "dp": None}, {}),
                      (None, {"bf16": {"enabled": True}})):
        d = {"engine": "deepspeed", "model": MODEL,
             "train": {"steps": N + M, "global_batch_size": 8, "micro_batch_size": 1},
             "deepspeed": {"config": {"zero_optimization": {"stage": 0}, **prec}},
             "checkpoint": {"dir": str(out), "resume": True}}
        if par:
            d["parallel"] = par
        with pytest.raises(ConfigError, match=r"is a universal checkpoint .* ZeRO-0 only in "
                                              r"fp32 without a pipeline; this run has ZeRO-0 "
                                              r"with (parallel.pp=2|bf16): use deepspeed=zero1"):
            deepspeed_runner.validate(build_run_config(d, world_size=4))


def test_only_malleus_checkpoints_are_exported(tmp_path, shared, capsys):
    from malleus_ds.app.cli import export_main

    assert export_main([str(shared["ds_zero1"][0]), str(tmp_path / "u"), "--to",
                        "deepspeed-universal"]) != 0
    assert "was saved by engine=deepspeed" in capsys.readouterr().err


def test_deepspeeds_own_universal_folders_load_under_any_plan(shared):
    """DeepSpeed's ``ds_to_universal`` output of a ZeRO-1 run (2 ranks) continues under
    engine=malleus (4 ranks, the non-uniform TP=2 plan) with stock DeepSpeed's losses."""
    _, full = shared["ds_zero1"]
    assert (shared["ds_universal"] / "latest_universal").is_file()
    for steps, losses in shared["theirs"]:
        assert steps == N
        np.testing.assert_allclose(losses, full[N:], rtol=2e-5)


def test_our_universal_folders_load_back(saved, shared):
    """Ours too: malleus -> universal -> malleus under the same plan continues exactly."""
    _, ours = saved
    rc, _, _ = shared["export"]["back"]
    assert rc == 0
    assert len(shared["back"]) == 4
    for steps, losses in shared["back"]:
        np.testing.assert_allclose(losses, ours[N:], rtol=2e-5)
