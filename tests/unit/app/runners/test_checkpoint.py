"""``checkpoint.*``: parsing, resume checks against ``run.json``, the save protocol (one process,
a fake engine writer) and the summary lines — no process group needed."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from malleus_ds.app import runners
from malleus_ds.app.run_config import CheckpointConfig, ConfigError
from malleus_ds.app.runners.base import DistEnv, RunSummary
from malleus_ds.app.runners.checkpoint import RUN_FILE, Checkpointer, CheckpointSaveError
from malleus_ds.app.runners.resume import resume_point, run_record
from malleus_ds.app.runners.common import format_summary
from tests.configs import cfg


def test_defaults_and_relative_dir(tmp_path, monkeypatch):
    assert cfg().checkpoint == CheckpointConfig(None, 0, False, True)
    assert not cfg().checkpoint.enabled
    monkeypatch.chdir(tmp_path)
    c = cfg(checkpoint={"dir": "ck", "every": 5}).checkpoint
    assert c == CheckpointConfig(str(tmp_path / "ck"), 5, False, True) and c.enabled
    assert cfg(checkpoint={"dir": 2024}).checkpoint.dir == str(tmp_path / "2024")


@pytest.mark.parametrize("section,pattern", [
    ({"dir": "x", "evry": 2}, r"checkpoint has unknown fields \['evry'\]; allowed: "
                              r"\['dir', 'every', 'resume', 'background', 'keep'\]"),
    ({"dir": "x", "keep": -1}, r"checkpoint.keep=-1 must be >= 0 \(the newest N checkpoints stay"),
    ({"dir": "x", "keep": "two"}, r"checkpoint.keep='two' must be an integer"),
    ({"dir": "x", "every": -1}, r"checkpoint.every=-1 must be >= 0"),
    ({"dir": "x", "every": 1.5}, r"checkpoint.every=1.5 must be an integer"),
    ({"dir": "x", "resume": "yes"}, r"checkpoint.resume='yes' must be true, false or auto"),
    ({"resume": "auto"}, r"checkpoint.resume=auto needs checkpoint.dir"),
    ({"every": 3}, r"checkpoint.every=3 needs checkpoint.dir"),
    ({"resume": True}, r"checkpoint.resume=true needs checkpoint.dir"),
    ({"dir": "  "}, r"checkpoint.dir='  ' must be a folder path"),
    ([1, 2], r"checkpoint must be a mapping"),
])
def test_bad_checkpoint_sections(section, pattern):
    with pytest.raises(ConfigError, match=pattern):
        cfg(checkpoint=section)


def test_default_yaml_has_the_section():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[4] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        c = compose(config_name="config", overrides=["checkpoint.dir=/tmp/x",
                                                     "checkpoint.every=2"])
    assert OmegaConf.to_container(c)["checkpoint"] == {"dir": "/tmp/x", "every": 2,
                                                       "resume": False, "background": True,
                                                       "keep": 0}


def _save(tmp_path, step=3, **kw):
    """A committed app checkpoint of ``cfg(**kw)`` at ``step`` (fake engine files)."""
    c = cfg(checkpoint={"dir": str(tmp_path)}, **kw)
    Checkpointer(c, DistEnv()).save(step, lambda root, tag, done: None)
    return c


def _resume(tmp_path, steps=6, train=None, **kw):
    return cfg(checkpoint={"dir": str(tmp_path), "resume": True},
               train={"steps": steps, **(train or {})}, **kw)


def test_save_protocol_writes_run_json_then_latest(tmp_path):
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 2}, train={"steps": 5})
    ck, seen = Checkpointer(c, DistEnv()), []

    def write(root, tag, done):
        seen.append((root, tag, done))
        assert not (root / tag / RUN_FILE).exists()       # committed only after the files
        (root / tag / "engine.pt").write_text("x")

    for done in range(1, 6):
        ck.after_step(done, write)
    ck.finish(5, write)
    ck.finish(5, write)                                    # already saved: no second save
    assert [s[1:] for s in seen] == [("global_step2", 2), ("global_step4", 4),
                                     ("global_step5", 5)]
    assert (tmp_path / "latest").read_text() == "global_step5"
    assert json.loads((tmp_path / "global_step4" / RUN_FILE).read_text()) == run_record(c, 4)
    assert ck.summary() == {"checkpoints": {"dir": str(tmp_path), "tags": [
        "global_step2", "global_step4", "global_step5"]}}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_failed_write_commits_nothing(tmp_path):
    _save(tmp_path, 2)
    c = cfg(checkpoint={"dir": str(tmp_path)})

    def write(root, tag, done):
        raise OSError("disk full")

    with pytest.raises(CheckpointSaveError, match=r"global_step4 failed on rank\(s\) \[0\]: rank 0: OSError: disk"):
        Checkpointer(c, DistEnv()).save(4, write)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not (tmp_path / "global_step4" / RUN_FILE).exists()


def test_keep_leaves_the_newest_checkpoints_and_never_what_latest_names(tmp_path):
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 1, "keep": 2}, train={"steps": 5})
    ck = Checkpointer(c, DistEnv())
    (tmp_path / "global_step0x").mkdir()               # not a checkpoint folder: left alone
    (tmp_path / "notes").mkdir()

    def write(root, tag, done):
        (root / tag / "engine.pt").write_text("x")

    for done in range(1, 6):
        ck.after_step(done, write)
        kept = sorted(p.name for p in tmp_path.glob("global_step*") if p.name[11:].isdigit())
        assert kept == [f"global_step{s}" for s in range(max(1, done - 1), done + 1)], kept
        assert (tmp_path / "latest").read_text() == f"global_step{done}"
    ck.finish(5, write)
    assert (tmp_path / "global_step0x").is_dir() and (tmp_path / "notes").is_dir()
    assert resume_point(_resume(tmp_path)).step == 5
    # keep=0 (the default) keeps them all
    c = cfg(checkpoint={"dir": str(tmp_path / "all"), "every": 1}, train={"steps": 3})
    ck = Checkpointer(c, DistEnv())
    for done in range(1, 4):
        ck.after_step(done, write)
    assert len(list((tmp_path / "all").glob("global_step*"))) == 3


def test_prune_reports_what_it_could_not_delete(tmp_path, monkeypatch):
    from malleus_ds.app.runners.checkpoint import prune

    for s in (1, 2, 3):
        (tmp_path / f"global_step{s}").mkdir()
        (tmp_path / f"global_step{s}" / RUN_FILE).write_text("{}")
    import shutil

    def no(p):
        raise PermissionError(f"read-only: {p}")

    monkeypatch.setattr(shutil, "rmtree", no)
    got = prune(tmp_path, 3, 1)
    assert [(p.name, "read-only" in (e or "")) for p, e in got] == [("global_step1", True),
                                                                    ("global_step2", True)]
    # run.json went first: what is left of a failed deletion is never a committed checkpoint
    assert not (tmp_path / "global_step1" / RUN_FILE).exists()


def test_resume_point_and_nothing_to_run(tmp_path):
    _save(tmp_path, 3)
    saved = resume_point(_resume(tmp_path))
    assert (saved.step, saved.tag, saved.path) == (3, "global_step3", tmp_path / "global_step3")
    assert resume_point(cfg()) is None
    # a checkpoint at or past train.steps: execute returns at once, no process group
    c = _resume(tmp_path, steps=3)
    s = runners.execute(c, DistEnv())
    assert s.losses == () and s.extra["nothing_to_run"]
    text = format_summary(c, s)
    assert f"resumed from step 3: {tmp_path / 'global_step3'}" in text
    assert "nothing to run: the checkpoint is at step 3 and train.steps=3" in text


def test_resume_without_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=f"checkpoint.dir={tmp_path} has no 'latest' file: "
                                          f"there is no checkpoint to continue from"):
        runners.validate(_resume(tmp_path))
    with pytest.raises(ConfigError, match="does not exist: there is no checkpoint"):
        runners.validate(_resume(tmp_path / "nope"))
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(ConfigError, match="'latest' names 'global_step9' but .* does not exist: "
                                          "an unfinished save"):
        runners.validate(_resume(tmp_path))


def test_resume_auto_starts_fresh_on_an_empty_folder_and_continues_from_a_checkpoint(tmp_path):
    from malleus_ds.app.runners.resume import start_line

    auto = cfg(checkpoint={"dir": str(tmp_path / "ck"), "resume": "AUTO"}, train={"steps": 6})
    assert auto.checkpoint.resume == "auto"
    runners.validate(auto)                              # no folder yet: not an error
    assert resume_point(auto) is None
    assert start_line(auto, None) == (f"[malleus_ds] checkpoint.resume=auto: starting fresh at "
                                      f"step 0 (checkpoint.dir={tmp_path / 'ck'} holds no "
                                      f"checkpoint yet)")
    ck = Checkpointer(auto, DistEnv())
    assert (ck.start, ck.resumed) == (0, None)
    ck.save(2, lambda root, tag, done: None)
    saved = resume_point(auto)                          # the same command line, restarted
    assert (saved.step, Checkpointer(auto, DistEnv()).start) == (2, 2)
    assert start_line(auto, saved) == (f"[malleus_ds] checkpoint.resume=auto: continuing from "
                                       f"step 2 ({tmp_path / 'ck' / 'global_step2'})")
    assert start_line(cfg(), None) is None
    # auto checks the checkpoint it finds like true does: another model is refused
    other = cfg(checkpoint={"dir": str(tmp_path / "ck"), "resume": "auto"},
                model={"name": "tiny", "num_layers": 2})
    with pytest.raises(ConfigError, match=r"holds another model: model.num_layers=4 there, 2"):
        resume_point(other)
    # and a 'latest' naming an unfinished save is an error, never a silent fresh start
    (tmp_path / "ck" / "latest").write_text("global_step9")
    with pytest.raises(ConfigError, match="an unfinished save"):
        resume_point(auto)


def test_resume_must_match_engine_model_batch_and_data(tmp_path):
    _save(tmp_path, 3)
    bad = [({"engine": "deepspeed"}, r"saved by engine=torch, this run has engine=deepspeed"),
           ({"model": {"name": "tiny", "num_layers": 2}},
            r"holds another model: model.num_layers=4 there, 2 here"),
           ({"train": {"global_batch_size": 16}},
            r"has train.global_batch_size=8, this run 16"),
           ({"train": {"data_seed": 5}}, r"has train.data_seed=0, this run 5")]
    for kw, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            resume_point(_resume(tmp_path, **kw))
    # engine=torch: every replica holds the whole state, so another world size is fine
    assert resume_point(_resume(tmp_path, world=4)).step == 3


def test_deepspeed_resume_needs_the_saving_layout(tmp_path):
    ds = {"deepspeed": {"config": {"zero_optimization": {"stage": 1}}}}
    _save(tmp_path, 2, engine="deepspeed", world=2, **ds)
    assert resume_point(_resume(tmp_path, engine="deepspeed", world=2, **ds)).step == 2
    with pytest.raises(ConfigError, match=r"world_size 2, this run has 4: stock DeepSpeed "
                                          r"checkpoints load only under the layout"):
        resume_point(_resume(tmp_path, engine="deepspeed", world=4, **ds))
    z2 = {"deepspeed": {"config": {"zero_optimization": {"stage": 2}}}}
    with pytest.raises(ConfigError, match=r"zero_optimization.stage 1, this run has 2"):
        resume_point(_resume(tmp_path, engine="deepspeed", world=2, **z2))
    pp = {"parallel": {"tp": 1, "pp": 2, "dp": None}}
    with pytest.raises(ConfigError, match=r"with parallel tp=1 pp=1 dp=2, this run has "
                                          r"tp=1 pp=2 dp=1"):
        resume_point(_resume(tmp_path, engine="deepspeed", world=2, **ds, **pp))


def test_a_deepspeed_folder_a_users_script_saved_resumes_under_malleus(tmp_path):
    """No run.json (``engine.save_checkpoint`` in the user's own script): engine=malleus
    continues at the step DeepSpeed's tag names (``global_step{N}``), else at the folder's
    ``global_steps``; engine=deepspeed is told to continue it in that script."""
    import torch

    for tag, step in (("global_step5", 5), ("my_tag", 7)):
        root = tmp_path / tag
        (root / tag).mkdir(parents=True)
        torch.save({"module": {}, "global_steps": 7}, root / tag / "mp_rank_00_model_states.pt")
        (root / "latest").write_text(tag)
        saved = resume_point(_resume(root, steps=9, engine="malleus"))
        assert saved.step == step and saved.meta["foreign"] and saved.tag == tag
        with pytest.raises(ConfigError, match=r"is a DeepSpeed checkpoint your own script saved "
                                              r"\(no run.json\): engine=malleus continues it"):
            resume_point(_resume(root, steps=9, engine="deepspeed"))


def test_summary_lines():
    c = cfg()
    s = RunSummary(engine="torch", losses=(5.0, 4.9), step_times_s=(0.1, 0.1), samples_per_step=8,
                   extra={"resumed_from": {"step": 4, "path": "/ck/global_step4"},
                          "checkpoints": {"dir": "/ck", "tags": [f"global_step{i}"
                                                                 for i in range(5, 11)]}})
    text = format_summary(c, s)
    assert "resumed from step 4: /ck/global_step4" in text
    assert ("checkpoints: 6 saved to /ck (global_step5, ..., global_step10; "
            "latest = global_step10)") in text


class _SlowWriter:
    """A writer whose save splits like MalleusEngine's: the snapshot returns at once, the write
    waits for the test to let it go (event-driven, no timing)."""

    can_snapshot = True

    def __init__(self, fail_at=None):
        import threading
        from collections import defaultdict

        self.go, self.snaps, self.fail_at = defaultdict(threading.Event), [], fail_at

    def __call__(self, root, tag, done):
        raise AssertionError("the background path never saves on the training thread")

    def snapshot(self, root, tag, done):
        self.snaps.append(done)

        def persist(agree):
            assert self.go[done].wait(30)
            err = None
            if done == self.fail_at:
                err = "rank 0 could not write: OSError: disk full"
            else:
                (root / tag / "engine.pt").write_text(str(done))
            agree(err, f"save_checkpoint({root / tag})")
        return persist


def test_a_background_save_commits_after_training_went_on_and_never_half(tmp_path):
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 2}, train={"steps": 6})
    assert c.checkpoint.background
    ck, w = Checkpointer(c, DistEnv()), _SlowWriter()
    ck.after_step(1, w)
    ck.after_step(2, w)                         # snapshot taken, write in flight
    assert w.snaps == [2] and not (tmp_path / "latest").exists()
    ck.after_step(3, w)                         # training goes on meanwhile
    assert not (tmp_path / "global_step2" / RUN_FILE).exists()
    w.go[2].set()
    ck.after_step(4, w)                         # the next save waits for the one in flight
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert json.loads((tmp_path / "global_step2" / RUN_FILE).read_text())["step"] == 2
    w.go[4].set()
    w.go[6].set()
    ck.finish(6, w)                             # the end-of-run save, and the wait for it
    assert (tmp_path / "latest").read_text() == "global_step6"
    assert ck.summary()["checkpoints"]["tags"] == ["global_step2", "global_step4",
                                                   "global_step6"]


def test_a_failed_background_write_is_raised_by_a_wait_that_must_and_commits_nothing(tmp_path):
    _save(tmp_path, 2)
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 2}, train={"steps": 6})
    ck, w = Checkpointer(c, DistEnv()), _SlowWriter(fail_at=4)
    ck.after_step(4, w)
    w.go[4].set()
    with pytest.raises(CheckpointSaveError, match=r"global_step4\) failed on rank\(s\) \[0\]: "
                                                  r"rank 0: rank 0 could not write"):
        ck.wait(then="no tries left")
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not (tmp_path / "global_step4").exists()          # the half-written folder: gone
    sync = cfg(checkpoint={"dir": str(tmp_path), "background": False})
    assert not sync.checkpoint.background
    seen = []
    Checkpointer(sync, DistEnv()).save(8, lambda root, tag, done: seen.append(done))
    assert seen == [8] and (tmp_path / "latest").read_text() == "global_step8"




class _Notes:
    """A reporter's ``note`` (the metrics.jsonl event lines)."""

    stop_signal = 0

    def __init__(self):
        self.lines = []

    def note(self, obj):
        self.lines.append(obj)


def _flaky(fail: set[int], seen: list):
    def write(root, tag, done):
        seen.append(done)
        (root / tag / "engine.pt").write_text(str(done))     # half a save is on disk...
        if done in fail:
            raise OSError(28, "No space left on device")     # ...when the disk fills up
    return write


def test_a_failed_periodic_save_warns_and_is_tried_again_while_training_goes_on(tmp_path, capsys):
    """Steps 2 and 3 cannot be saved (a full disk): training goes on, the save is tried again
    after 1 then 2 steps, ``latest`` names the last committed checkpoint throughout, each
    half-written folder is removed, and the summary and metrics.jsonl say what happened."""
    _save(tmp_path, 0)
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 4, "background": False},
            train={"steps": 8})
    ck, seen, notes = Checkpointer(c, DistEnv()), [], _Notes()
    write = _flaky({4, 5}, seen)
    for done in range(1, 9):
        ck.after_step(done, write, notes)
        if done in (4, 5, 6):
            assert (tmp_path / "latest").read_text() == ("global_step0" if done < 7 else "")
    ck.finish(8, write, notes)
    assert seen == [4, 5, 7, 8]          # 4 failed: again after 1 step; 5 failed: after 2
    assert (tmp_path / "latest").read_text() == "global_step8"
    assert not (tmp_path / "global_step4").exists() and not (tmp_path / "global_step5").exists()
    failed = [n for n in notes.lines if n["event"] == "checkpoint_failed"]
    assert [(n["step"], n["latest"]) for n in failed] == [(4, "global_step0"), (5, "global_step0")]
    assert "No space left on device" in failed[0]["error"]
    assert failed[0]["then"] == "training goes on; trying again after step 5"
    assert failed[1]["then"] == "training goes on; trying again after step 7"
    err = capsys.readouterr().err
    assert err.count("[malleus_ds] warning: saving checkpoint") == 2, err
    assert f"the latest checkpoint is {tmp_path / 'global_step0'}" in err
    summary = ck.summary()
    assert [f["step"] for f in summary["failed_saves"]] == [4, 5]
    assert summary["checkpoints"]["tags"] == ["global_step7", "global_step8"]
    text = format_summary(c, RunSummary(engine="torch", losses=(1.0,), step_times_s=(0.1,),
                                        samples_per_step=8, extra=summary))
    assert "checkpoint saves that failed and were tried again: 2 (steps 4, 5; the last: " in text


def test_the_end_of_run_save_is_tried_again_then_raised(tmp_path, monkeypatch):
    import malleus_ds.app.runners.checkpoint as ckmod

    slept = []
    monkeypatch.setattr(ckmod.time, "sleep", slept.append)
    _save(tmp_path, 2)
    c = cfg(checkpoint={"dir": str(tmp_path), "background": False}, train={"steps": 4})
    seen = []
    ck = Checkpointer(c, DistEnv())
    ck.after_step(3, _flaky({4}, seen))
    with pytest.raises(CheckpointSaveError, match=r"No space left on device \(3 tries; the "
                                                  r"latest checkpoint is .*global_step2\)"):
        ck.finish(4, _flaky({4}, seen))
    assert seen == [4, 4, 4] and slept == [ckmod.MUST_WAIT_S, 2 * ckmod.MUST_WAIT_S]
    assert (tmp_path / "latest").read_text() == "global_step2"
    # a disk that is back for the second try: the run ends with its checkpoint
    seen.clear()
    slept.clear()
    ck = Checkpointer(c, DistEnv())
    tries = iter([True, False])
    ck.finish(4, lambda root, tag, done: _flaky({4} if next(tries) else set(), seen)(
        root, tag, done))
    assert seen == [4, 4] and slept == [ckmod.MUST_WAIT_S]
    assert (tmp_path / "latest").read_text() == "global_step4"


def test_a_failed_background_save_is_tried_again_by_the_next_one(tmp_path):
    _save(tmp_path, 2)
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 2}, train={"steps": 6})
    ck, w, notes = Checkpointer(c, DistEnv()), _SlowWriter(fail_at=4), _Notes()
    ck.after_step(4, w, notes)
    w.go[4].set()
    ck.after_step(5, w, notes)                   # the failure is not known before a wait
    w.go[6].set()
    ck.after_step(6, w, notes)                   # ...which the next save makes: noted, and on
    ck.finish(6, w, notes)
    assert (tmp_path / "latest").read_text() == "global_step6"
    assert [n["step"] for n in notes.lines if n["event"] == "checkpoint_failed"] == [4]
    assert [f["step"] for f in ck.summary()["failed_saves"]] == [4]


def test_a_stop_whose_checkpoint_cannot_be_written_still_stops(tmp_path, monkeypatch):
    """SIGTERM while the checkpoint disk is read-only (the long fault campaign's seed 27): the
    stop's save fails its 3 tries, and the run stops all the same, saying which checkpoint the
    next run continues from. (It raised CheckpointSaveError, and torchrun restarted the job it
    had been asked to end.)"""
    import signal

    import malleus_ds.app.runners.checkpoint as ckmod
    from malleus_ds.app.runners.guard import Stopped

    monkeypatch.setattr(ckmod.time, "sleep", lambda s: None)
    _save(tmp_path, 2)
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 0, "background": False},
            train={"steps": 8})
    ck, seen, notes = Checkpointer(c, DistEnv()), [], _Notes()
    notes.stop_signal = signal.SIGTERM
    notes.close = lambda: None
    with pytest.raises(Stopped) as got:
        ck.after_step(5, _flaky({5}, seen), notes)
    assert seen == [5, 5, 5] and got.value.exit_code == 128 + signal.SIGTERM
    assert got.value.checkpoint is None and got.value.step == 5
    msg = str(got.value)
    assert msg.startswith("stopped by SIGTERM after step 5; its checkpoint could not be written, "
                          "so the next run continues from the latest one"), msg
    assert "(3 tries; the latest checkpoint is " in msg and "global_step2" in msg
    assert (tmp_path / "latest").read_text() == "global_step2"
