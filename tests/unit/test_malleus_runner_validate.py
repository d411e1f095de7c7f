"""engine=malleus checks the precision sections of the ds_config before any process group."""
import pytest

from malleus_ds import runners
from malleus_ds.config import ConfigError
from tests.unit.test_config import cfg


def _malleus(ds_extra):
    return cfg(world=2, engine="malleus", plan="static",
               deepspeed={"config": {"zero_optimization": {"stage": 1}, **ds_extra}})


def test_both_precisions_rejected_before_launch():
    c = _malleus({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        runners.validate(c)


def test_bf16_passes_validation():
    runners.validate(_malleus({"bf16": {"enabled": True}}))
