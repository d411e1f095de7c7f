"""A rank killed while it writes a checkpoint: latest stays on the last complete one
(app/runners/checkpoint.py), with real processes."""
from __future__ import annotations

import os

import pytest

from malleus_ds.app.runners.base import DistEnv
from malleus_ds.app.runners.checkpoint import Checkpointer
from malleus_ds.app.runners.resume import resume_point
from tests.configs import cfg
from tests.unit.app.runners.test_checkpoint import _SlowWriter


def _die_mid_write(tmp_path, background: bool) -> None:
    """A child process saves step 2, then is killed (os._exit) halfway through writing step 4's
    engine file: on the training thread, or on the background writer's thread."""
    c = cfg(checkpoint={"dir": str(tmp_path), "every": 2, "background": background},
            train={"steps": 6})
    ck = Checkpointer(c, DistEnv())

    def half(root, tag, done):
        with open(root / tag / "engine.pt", "w") as f:
            f.write("half of step 4")
            f.flush()
            os._exit(9)                          # SIGKILL-like: no clean-up runs

    if background:
        class W(_SlowWriter):
            def snapshot(self, root, tag, done):
                if done == 4:
                    return lambda agree: half(root, tag, done)
                self.go[done].set()
                return super().snapshot(root, tag, done)
        w = W()
    else:
        def w(root, tag, done):
            if done == 4:
                half(root, tag, done)
            (root / tag / "engine.pt").write_text(str(done))
    for done in range(1, 6):
        ck.after_step(done, w)
    ck.wait()
    os._exit(0)                                  # not reached: the write of step 4 dies


@pytest.mark.parametrize("background", [True, False])
def test_a_rank_killed_mid_write_leaves_latest_on_the_last_complete_checkpoint(tmp_path,
                                                                             background):
    import multiprocessing as mp

    p = mp.get_context("fork").Process(target=_die_mid_write, args=(tmp_path, background))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    assert (tmp_path / "global_step4" / "engine.pt").read_text() == "half of step 4"
    assert (tmp_path / "latest").read_text() == "global_step2"
    auto = cfg(checkpoint={"dir": str(tmp_path), "resume": "auto"}, train={"steps": 6})
    saved = resume_point(auto)                   # the restart continues from step 2
    assert (saved.step, saved.tag) == (2, "global_step2")
