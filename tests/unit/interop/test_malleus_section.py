"""The ``malleus`` section's key lists come from the dataclasses that read it
(``interop/malleus_section.py``): a field is its key, renamed or left out by its metadata."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

import pytest

from malleus_ds.interop.malleus_section import ADAPTIVE_KEYS, KEY, section_keys


def test_a_field_is_its_key_unless_its_metadata_says_otherwise():
    @dataclass(frozen=True)
    class View:
        on: bool = field(default=True, metadata={KEY: "adaptive"})
        seed: int = 0
        derived: float = field(default=0.0, metadata={KEY: None})

    assert section_keys(View) == ("adaptive", "seed")


def test_the_three_views_keys():
    from malleus_ds.adaptive.settings import ADAPTIVE_KEYS, AdaptiveSettings
    from malleus_ds.app.config import MALLEUS_KEYS
    from malleus_ds.engine.settings import MalleusSettings

    assert ADAPTIVE_KEYS == ("adaptive", "detect", "check", "horizon_steps", "replan_at",
                             "planner_time_limit_s", "min_improvement", "migrate_gbps",
                             "tp_slowdown", "device_mb")
    assert MALLEUS_KEYS == ("switch", "migrate_bucket_mb", "migrate_timeout_s", *ADAPTIVE_KEYS)
    assert set(section_keys(MalleusSettings)) == {"plan", "tp", "gpus_per_node", "seed",
                                                  "straggler", "switch", "migrate_bucket_mb",
                                                  "migrate_timeout_s"}
    assert AdaptiveSettings.from_config({}) == AdaptiveSettings()     # defaults written once
    assert MalleusSettings.from_config({}) == MalleusSettings()


def test_the_engine_accepts_exactly_its_keys_and_the_loops():
    """The engine reads its own keys and leaves the loop's (derived from ``AdaptiveSettings``,
    which lives below both) to the loop: a section may hold any of them, and nothing else."""
    from malleus_ds.engine.settings import MalleusSettings

    with pytest.raises(ValueError, match=r"unknown keys \['nope'\]") as e:
        MalleusSettings.from_config({"nope": 1})
    allowed = ast.literal_eval(str(e.value).split("allowed: ", 1)[1])
    assert allowed == sorted({*section_keys(MalleusSettings), *ADAPTIVE_KEYS})
    assert MalleusSettings.from_config(dict.fromkeys(ADAPTIVE_KEYS)) == MalleusSettings()
