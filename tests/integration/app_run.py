"""``launch/train.py``'s runs without its launch: the same Hydra config (composed from conf/
with the command line's overrides, as the app does) run by ``runners.run`` on harness ranks.

For tests whose subject is what a run leaves behind (a checkpoint to resume, poison, refuse),
not the launch: a harness rank starts in ~0.3 CPU s, a CLI rank under torchrun in ~3.5 plus
the launcher's and torchrun agent's ~3. Several runs share one set of ranks (an app run after
another, in the same process group), as ``--multirun`` would not.
"""
from __future__ import annotations

from pathlib import Path

from tests.integration.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def compose(overrides: list[str]) -> dict:
    """The plain config ``launch/train.py OVERRIDES`` builds its RunConfig from."""
    from hydra import compose as _compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(_compose(config_name="config", overrides=overrides),
                                      resolve=True)


def _ranks(rank, world, jobs):
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    out = []
    for plain, run_dir in jobs:
        rc = build_run_config(plain, world_size=world, local_world_size=world,
                              run_dir=str(run_dir) if rank == 0 and run_dir else None,
                              ds_search_dirs=(CONF / "deepspeed",))
        out.append(list(runners.run(rc, runners.DistEnv.from_environ("cpu")).losses))
    return out


def run_app(world: int, *jobs: tuple[list[str], Path | None], timeout: float = 600.0):
    """Each job ``(overrides, run_dir)`` in turn on the same ``world`` ranks, as
    ``launch/train.py OVERRIDES hydra.run.dir=RUN_DIR`` would run it on ``world`` ranks (rank 0
    writes RUN_DIR/metrics.jsonl; ``None``: no run folder): [[losses per job] per rank]."""
    plain = [(compose(list(o)), d) for o, d in jobs]
    return run_distributed(_ranks, world, plain, timeout=timeout,
                           env={"LOCAL_WORLD_SIZE": str(world)})
