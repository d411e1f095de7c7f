"""The way back (``malleus-export --to deepspeed-universal``, ``export/ds_universal.py``):
engine=malleus for N steps under a non-uniform TP=2 plan, exported as a DeepSpeed universal
checkpoint, continues under stock DeepSpeed (engine=deepspeed, ZeRO-1 and ZeRO-2 on 2 ranks)
with the losses engine=malleus gets continuing itself."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.integration.test_deepspeed_checkpoint_import import (  # noqa: F401 - a fixture
    M, N, _other_plan, _run, ds_zero1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("universal")
    plan = _other_plan(tmp)
    ours = run_distributed(_run, 4, "malleus", 1, N + M, tmp / "full", False, plan,
                           timeout=300)[0]
    run_distributed(_run, 4, "malleus", 1, N, tmp / "ck", False, plan, timeout=300)
    return tmp, ours


@pytest.mark.parametrize("zero", [1, 2])
def test_stock_deepspeed_continues_an_exported_malleus_checkpoint(saved, zero, capsys):
    from malleus_ds.app.cli import export_main

    tmp, ours = saved
    out = tmp / f"universal{zero}"
    assert export_main([str(tmp / "ck"), str(out), "--to", "deepspeed-universal"]) == 0
    assert "wrote DeepSpeed universal checkpoint" in capsys.readouterr().out
    tag = out / f"global_step{N}"
    assert (out / "latest_universal").read_text() == tag.name
    assert (tag / "zero" / "blocks.0.attn.wq.weight" / "exp_avg.pt").is_file()
    rec = json.loads((tag / "run.json").read_text())
    assert rec["engine"] == "deepspeed" and rec["universal"] is True and rec["step"] == N
    got = run_distributed(_run, 2, "deepspeed", zero, N + M, out, True, timeout=300)
    for r, losses in enumerate(got):
        np.testing.assert_allclose(losses, ours[N:], rtol=2e-5, err_msg=f"rank {r}")


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
