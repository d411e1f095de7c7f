"""``straggler.link_schedule`` on 4 gloo ranks as 2 nodes of 2 (``emulation/links.py``): the
messages and reductions that cross the slowed link wait, on the steps the schedule names and no
others (``link_emulated_s`` of metrics.jsonl), and the losses are those of the run without it.
Two layouts: data parallel over both nodes (every reduction crosses the link), and two-stage
pipelines across it (the sends cross it; each stage's reduction stays inside its node)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.harness import run_distributed

STEPS = 6
SLOW = [{"nodes": [0, 1], "rate": 3.0, "start_step": 2, "end_step": 4}]


def _run(rank, world, pp, links, run_dir):
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    d = {"engine": "malleus", "progress": False,
         "model": {"name": "tiny", "num_layers": 4, "hidden_size": 32, "num_heads": 4,
                   "max_seq_len": 32},
         "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 1, "seed": 5},
         "parallel": {"tp": 1, "pp": pp, "dp": None}, "cluster": {"nodes": 2, "gpus_per_node": 2},
         "straggler": {"schedule": [], "link_schedule": links},
         "deepspeed": {"config": {"zero_optimization": {"stage": 1}}},
         "malleus": {"adaptive": False}}
    cfg = build_run_config(d, world_size=world, run_dir=str(run_dir) if run_dir else None)
    return list(runners.run(cfg, runners.DistEnv.from_environ("cpu")).losses)


@pytest.mark.parametrize("pp", [1, 2], ids=["dp-across", "pipeline-across"])
def test_a_slowed_link_delays_what_crosses_it_and_nothing_else(tmp_path, pp):
    ref = run_distributed(_run, 4, pp, [], None, timeout=240)[0]
    got = run_distributed(_run, 4, pp, SLOW, tmp_path, timeout=240)
    for r, losses in enumerate(got):
        np.testing.assert_allclose(losses, ref, rtol=1e-6, err_msg=f"rank {r}")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {x["step"]: x["link_emulated_s"] for x in lines if "step_time_s" in x}
    assert sorted(steps) == list(range(STEPS))
    for s, waited in steps.items():
        if s in (2, 3):
            # data parallel: every rank's reduction crosses the link; pipelines: the receiving
            # ranks of each boundary (stage 1 receives activations, stage 0 gradients)
            assert all(w > 0 for w in waited), (s, waited)
        else:
            assert all(w == 0 for w in waited), (s, waited)
