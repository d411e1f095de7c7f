"""The way back (``malleus-export --to deepspeed-universal``, ``export/ds_universal.py``):
engine=malleus for N steps under a non-uniform TP=2 plan, exported as a DeepSpeed universal
checkpoint, continues under stock DeepSpeed in every layout it trains (engine=deepspeed ZeRO-0,
-1 and -2 on 2 ranks; PipelineEngine pp=2 x dp=2 with ZeRO-1) with the losses engine=malleus
gets continuing itself."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.integration.test_deepspeed_checkpoint_import import (  # noqa: F401 - a fixture
    MODEL, M, N, _other_plan, _run, ds_zero1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """engine=malleus for N+M steps saving at N: its losses, and the step-N save as latest."""
    import shutil

    tmp = tmp_path_factory.mktemp("universal")
    ours = run_distributed(_run, 4, "malleus", 1, N + M, tmp / "ck", False, _other_plan(tmp),
                           None, 1, N, timeout=300)[0]
    shutil.rmtree(tmp / "ck" / f"global_step{N + M}")
    (tmp / "ck" / "latest").write_text(f"global_step{N}")
    return tmp, ours


@pytest.mark.parametrize("zero,pp", [(0, 1), (1, 1), (2, 1), (1, 2)],
                         ids=["zero0", "zero1", "zero2", "pipeline-zero1"])
def test_stock_deepspeed_continues_an_exported_malleus_checkpoint(saved, zero, pp, capsys):
    """ZeRO-1/2 and PipelineEngine through DeepSpeed's universal load (the pipeline under its
    PipelineModule names); ZeRO-0 as a plain save (the model-states file's module and torch
    AdamW state)."""
    from malleus_ds.app.cli import export_main

    tmp, ours = saved
    out = tmp / f"universal{zero}{pp}"
    assert export_main([str(tmp / "ck"), str(out), "--to", "deepspeed-universal"]) == 0
    assert "wrote DeepSpeed universal checkpoint" in capsys.readouterr().out
    tag = out / f"global_step{N}"
    assert (out / "latest_universal").read_text() == tag.name
    assert (tag / "zero" / "blocks.0.attn.wq.weight" / "exp_avg.pt").is_file()
    rec = json.loads((tag / "run.json").read_text())
    assert rec["engine"] == "deepspeed" and rec["universal"] is True and rec["step"] == N
    assert (tag / "zero" / "1.layer.attn.wq.weight" / "exp_avg.pt").is_file()
    got = run_distributed(_run, 2 * pp, "deepspeed", zero, N + M, out, True, None, None, pp,
                          timeout=300)
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


def test_only_malleus_checkpoints_are_exported(tmp_path, ds_zero1, capsys):
    from malleus_ds.app.cli import export_main

    assert export_main([str(ds_zero1[0]), str(tmp_path / "u"), "--to",
                        "deepspeed-universal"]) != 0
    assert "was saved by engine=deepspeed" in capsys.readouterr().err


def test_deepspeeds_own_universal_folders_load_under_any_plan(tmp_path, ds_zero1):
    """DeepSpeed's ``ds_to_universal`` output of a ZeRO-1 run continues under engine=malleus
    (4 ranks, the non-uniform TP=2 plan) with stock DeepSpeed's losses."""
    import subprocess
    import sys

    from tests.integration.test_deepspeed_checkpoint_import import _initialize_and_load

    ck, full = ds_zero1
    tag = f"global_step{N}"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(ck / tag), "--output_folder",
                    str(tmp_path / "uni" / tag), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True,
                   capture_output=True, timeout=300)
    assert (tmp_path / "uni" / "latest_universal").is_file()
    got = run_distributed(_initialize_and_load, 4, tmp_path / "uni", _other_plan(tmp_path),
                          timeout=300)
    for steps, losses in got:
        assert steps == N
        np.testing.assert_allclose(losses, full[N:], rtol=2e-5)


def test_our_universal_folders_load_back(saved):
    """Ours too: malleus -> universal -> malleus under the same plan continues exactly."""
    from malleus_ds.app.cli import export_main
    from tests.integration.test_deepspeed_checkpoint_import import _initialize_and_load

    tmp, ours = saved
    out = tmp / "back"
    assert export_main([str(tmp / "ck"), str(out), "--to", "deepspeed-universal"]) == 0
    got = run_distributed(_initialize_and_load, 4, out, _other_plan(tmp), timeout=300)
    for steps, losses in got:
        np.testing.assert_allclose(losses, ours[N:], rtol=2e-5)
