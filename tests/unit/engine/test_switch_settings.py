"""``malleus.switch`` entries: parsed and checked before any process group exists."""
import json

import pytest

from malleus_ds.engine.settings import MalleusSettings, parse_switch
from malleus_ds.plan import static_plan


@pytest.fixture()
def plan_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(static_plan(4, 8, 1, 1, 2, 1).dumps())
    return str(p)


def test_entries_parse_in_order(plan_file):
    sw = parse_switch([{"step": 2, "plan": plan_file},
                       {"step": 5, "plan": json.loads(open(plan_file).read())}])
    assert [s.step for s in sw] == [2, 5] and sw[0].plan == sw[1].plan
    assert sw[1].where == "ds_config.malleus.switch[1]"
    assert parse_switch(None) == () == parse_switch([])


@pytest.mark.parametrize("entries,msg", [
    ("a.json", "must be a list"),
    ([{"step": 2}], r"switch\[0\]: expected \{step: K, plan: PATH\}"),
    ([{"step": 0, "plan": "x"}], r"switch\[0\].step=0 must be an integer >= 1"),
    ([{"step": True, "plan": "x"}], r"switch\[0\].step=True"),
    ([{"step": 3, "plan": "/nope/missing.json"}], r"switch\[0\].plan: plan: file not found"),
])
def test_bad_entries_name_the_entry(entries, msg):
    with pytest.raises(ValueError, match=msg):
        parse_switch(entries)


def test_steps_must_increase(plan_file):
    with pytest.raises(ValueError, match=r"switch\[1\].step=3 is not after the previous entry's "
                                         r"step 3"):
        parse_switch([{"step": 3, "plan": plan_file}, {"step": 3, "plan": plan_file}])


def test_migration_knobs_are_positive_numbers():
    s = MalleusSettings.from_config({"migrate_bucket_mb": 8, "migrate_timeout_s": 30})
    assert (s.migrate_bucket_mb, s.migrate_timeout_s) == (8.0, 30.0)
    for bad in (0, -1, "big", True):
        with pytest.raises(ValueError, match="migrate_bucket_mb"):
            MalleusSettings.from_config({"migrate_bucket_mb": bad})
