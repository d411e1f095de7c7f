"""Every config in conf/ composes (Hydra compose API) and turns into a valid RunConfig."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from malleus_ds.app.config import build_run_config

CONF = Path(__file__).resolve().parents[3] / "conf"
# groups owned by other parts of the project are composed by their own tests
SKIP_GROUPS = {"planner", "hydra", "data"}   # data=tokens needs a file (test_data_tokens.py)


def _options():
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in SKIP_GROUPS):
        for f in sorted(group.glob("*.yaml")):
            if (group.name, f.stem) != ("model", "hf_local"):   # needs a folder: test_hf_model.py
                yield group.name, f.stem


# world sizes that fit each option's layout
WORLD = {("parallel", "tp2"): 2, ("parallel", "pp2"): 2, ("cluster", "8x8"): 64,
         ("experiment", "pipeline"): 2}
EXTRA = {("cluster", "8x8"): ["train.global_batch_size=64"]}


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_default_config_composes():
    c = _compose([])
    rc = build_run_config(OmegaConf.to_container(c, resolve=True), world_size=1,
                          ds_search_dirs=(CONF / "deepspeed",))
    assert rc.engine == "torch" and rc.model.name == "tiny" and rc.deepspeed.zero_stage == 1


@pytest.mark.parametrize("group,option", list(_options()), ids=lambda x: str(x))
def test_every_option_composes(group, option):
    c = _compose([f"{group}={option}", *EXTRA.get((group, option), [])])
    d = OmegaConf.to_container(c, resolve=True)
    rc = build_run_config(d, world_size=WORLD.get((group, option), 2),
                          ds_search_dirs=(CONF / "deepspeed",))
    if group == "model":
        assert rc.model.name == ("tiny-llama" if option == "hf" else option)
    if group == "deepspeed":
        assert rc.deepspeed.config_file and rc.deepspeed.config_file.endswith(f"{option}.json")


def test_contract_overrides_exist():
    c = _compose(["engine=deepspeed", "model=tiny", "model.num_layers=6", "model.hidden_size=32",
                  "model.num_heads=2", "train.steps=3", "train.global_batch_size=4",
                  "train.micro_batch_size=2", "train.seed=7", "train.lr=0.01", "parallel.tp=1",
                  "parallel.pp=2", "parallel.dp=1", "deepspeed=zero2", "plan=static",
                  "cluster.gpus_per_node=2",
                  "straggler.schedule=[{rank:1,rate:4.0,start_step:5,end_step:100}]"])
    rc = build_run_config(OmegaConf.to_container(c, resolve=True), world_size=2,
                          ds_search_dirs=(CONF / "deepspeed",))
    assert (rc.model.num_layers, rc.model.hidden_size, rc.model.num_heads) == (6, 32, 2)
    assert (rc.train.steps, rc.train.global_batch_size, rc.train.micro_batch_size) == (3, 4, 2)
    assert (rc.train.seed, rc.train.lr, rc.parallel.pp) == (7, 0.01, 2)
    assert rc.straggler.rate(1, 5) == 4.0 and rc.straggler.rate(1, 100) == 1.0
    assert rc.deepspeed.zero_stage == 2 and rc.cluster.gpus_per_node == 2


def test_yaml_defaults_equal_the_dataclasses():
    """Defaults live in the dataclasses (``run_config.py``, the loop's and the engine's settings);
    conf/config.yaml repeats them for ``--help`` and overrides. Parsing the composed defaults
    must give exactly the dataclasses' defaults, section by section."""
    from malleus_ds.app.run_config import CheckpointConfig, MalleusConfig, TrainConfig

    c = OmegaConf.to_container(_compose(["engine=malleus"]), resolve=True)
    rc = build_run_config(c, world_size=1, ds_search_dirs=(CONF / "deepspeed",))
    assert rc.malleus == MalleusConfig()
    assert rc.train == TrainConfig()
    assert rc.checkpoint == CheckpointConfig()
    assert rc.comm_timeout_s == 1800.0 and rc.hang_timeout_s == 300.0 and rc.log_every == 10
    # and a default that moves in the YAML alone is caught
    c["malleus"]["detect"]["window"] += 1
    assert build_run_config(c, world_size=1, ds_search_dirs=(CONF / "deepspeed",)).malleus \
        != MalleusConfig()
