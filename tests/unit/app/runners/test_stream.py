"""Streamed logs (app/runners/stream.py): progress lines, train.log, monitor events, monitor packages."""
import io
import logging

import pytest

from malleus_ds.app import runners
from malleus_ds.app.run_config import ConfigError
from malleus_ds.app.runners.stream import (
    StepStream,
    TrainLog,
    check_monitor_packages,
    format_progress,
    format_startup,
    monitor_events,
    should_log)
from tests.configs import cfg


class FakeMonitor:
    def __init__(self, enabled=True):
        self.enabled, self.calls = enabled, []

    def write_events(self, events):
        self.calls.append(list(events))


class FakeLog:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def _stream(steps=7, every=3, tty=False, monitor=None, **kw):
    c = cfg(train={"steps": steps}, log_every=every, **kw)
    out, log = io.StringIO(), FakeLog()
    return StepStream(c, monitor=monitor, stdout=out, tty=tty, train_log=log), out, log


def test_should_log_every_n_and_the_last_step():
    assert [d for d in range(1, 8) if should_log(d, 7, 3)] == [3, 6, 7]
    assert [d for d in range(1, 7) if should_log(d, 6, 2)] == [2, 4, 6]
    assert [d for d in range(1, 4) if should_log(d, 3, 10)] == [3]
    assert [d for d in range(1, 4) if should_log(d, 3, 1)] == [1, 2, 3]


def test_format_matches_the_documented_line():
    assert format_progress(20, 100, 5.81234, 41.23, 0.1941, 3, 0.1512) == (
        "[malleus_ds] step 20/100 loss 5.8123 | 41.2 samples/s | step 0.194 s | "
        "slowest rank 3 (compute 0.151 s)")


def test_lines_average_over_the_steps_since_the_previous_line():
    s, out, log = _stream(steps=5, every=2)
    assert s.step(0, 6.0, 0.1, [0.05, 0.09]) is None
    line = s.step(1, 5.5, 0.3, [0.07, 0.01])        # window: steps 0-1
    # 8 samples x 2 steps / 0.4 s = 40/s; mean step 0.2 s; rank 0 mean 0.06 > rank 1 mean 0.05
    assert line == ("[malleus_ds] step 2/5 loss 5.5000 | 40.0 samples/s | step 0.200 s | "
                    "slowest rank 0 (compute 0.060 s)")
    s.step(2, 5.0, 0.2, [0.01, 0.1])
    s.step(3, 4.5, 0.2, [0.01, 0.1])
    last = s.step(4, 4.0, 0.1, [0.02, 0.3])          # last step: a window of one
    assert last == ("[malleus_ds] step 5/5 loss 4.0000 | 80.0 samples/s | step 0.100 s | "
                    "slowest rank 1 (compute 0.300 s)")
    assert out.getvalue().splitlines() == log.lines == s.lines
    assert [x.split()[2] for x in s.lines] == ["2/5", "4/5", "5/5"]


def test_a_terminal_gets_no_lines_but_train_log_does():
    s, out, log = _stream(steps=2, every=1, tty=True)
    s.step(0, 1.0, 0.1, [0.1])
    s.step(1, 1.0, 0.1, [0.1])
    assert out.getvalue() == "" and len(log.lines) == 2


def test_progress_false_keeps_lines_on_non_terminal_output():
    s, out, _ = _stream(steps=2, every=1, progress=False)
    s.step(0, 1.0, 0.1, [0.1, 0.2])
    assert "step 1/2" in out.getvalue()


def test_resumed_run_counts_steps_from_the_checkpoint():
    s, out, _ = _stream(steps=10, every=4)
    for step in range(5, 10):                         # resumed at step 5
        s.step(step, 1.0, 0.5, [0.1, 0.1])
    assert [x.split()[2] for x in out.getvalue().splitlines()] == ["8/10", "10/10"]
    assert "| 16.0 samples/s | step 0.500 s" in s.lines[0]   # steps 5, 6, 7


def test_startup_line_says_how_long_and_what_a_model_folder_cost():
    assert format_startup(12.345, 0, 100) == "[malleus_ds] ready after 12.3 s; training steps 1-100"
    assert format_startup(3.0, 20, 30).endswith("training steps 21-30")      # resumed at 20

    class Loaded:
        load_stats = {"tensors": 19, "bytes": 3 * 2 ** 20, "files": {"a", "b"}, "of_files": 6,
                      "seconds": 0.25}
    assert format_startup(5.0, 0, 4, Loaded()) == (
        "[malleus_ds] ready after 5.0 s; training steps 1-4; rank 0 read 19 tensors (3.0 MiB) "
        "from 2 of 6 weight file(s) in 0.2 s")
    Loaded.load_stats = dict(Loaded.load_stats, tensors=0)        # random init: nothing read
    assert "rank 0 read" not in format_startup(5.0, 0, 4, Loaded())
    s, out, log = _stream(steps=4, tty=True)            # printed even on a terminal, and logged
    line = s.startup(1.5, 0)
    assert out.getvalue() == line + "\n" and log.lines == [line]


def test_monitor_gets_throughput_step_time_and_per_rank_compute_every_step():
    mon = FakeMonitor()
    s, _, _ = _stream(steps=3, every=10, monitor=mon)
    s.step(0, 1.0, 0.25, [0.1, 0.2])
    s.step(1, 1.0, 0.5, [0.3, 0.4])
    assert mon.calls[0] == [("Train/Samples/samples_per_s", 32.0, 8),
                            ("Train/Samples/step_time_s", 0.25, 8),
                            ("Train/Samples/compute_s_rank0", 0.1, 8),
                            ("Train/Samples/compute_s_rank1", 0.2, 8)]
    assert [e[2] for e in mon.calls[1]] == [16] * 4 and mon.calls[1][0][1] == 16.0


def test_a_disabled_or_missing_monitor_gets_nothing():
    mon = FakeMonitor(enabled=False)
    s, _, _ = _stream(steps=1, every=1, monitor=mon)
    s.step(0, 1.0, 0.1, [0.1])
    assert mon.calls == []
    assert monitor_events(0, 8, 0.0, [])[0] == ("Train/Samples/samples_per_s", 0.0, 8)


def test_train_log_uses_the_root_file_handler_only(tmp_path):
    root = logging.getLogger()
    fh = logging.FileHandler(tmp_path / "train.log")
    fh.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    console = io.StringIO()
    sh = logging.StreamHandler(console)
    root.addHandler(fh)
    root.addHandler(sh)
    try:
        TrainLog(str(tmp_path / "elsewhere")).write("[malleus_ds] step 1/1")
    finally:
        root.removeHandler(fh)
        root.removeHandler(sh)
        fh.close()
    assert (tmp_path / "train.log").read_text() == (
        "[malleus_ds.progress][INFO] - [malleus_ds] step 1/1\n")
    assert console.getvalue() == "" and not (tmp_path / "elsewhere").exists()


def test_train_log_without_hydra_appends_to_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    log = TrainLog(str(tmp_path))
    log.write("a")
    log.write("b")
    assert (tmp_path / "train.log").read_text() == "a\nb\n"
    TrainLog(None).write("nowhere")                   # no run folder (ranks > 0): no file


def _ds(engine, ds_extra):
    extra = {"plan": "static"} if engine == "malleus" else {}
    return cfg(world=2, engine=engine, **extra,
               deepspeed={"config": {"zero_optimization": {"stage": 1}, **ds_extra}})


@pytest.mark.parametrize("section, module, pip", [
    ("wandb", "wandb", "pip install wandb"),
    ("tensorboard", "tensorboard", "pip install tensorboard"),
    ("comet", "comet_ml", 'pip install "comet_ml>=3.41.0"'),
])
def test_missing_monitor_package_is_a_config_error(section, module, pip):
    asked = []

    def find_spec(name):
        asked.append(name)
        return None

    c = _ds("deepspeed", {section: {"enabled": True}})
    with pytest.raises(ConfigError) as e:
        check_monitor_packages(c, find_spec=find_spec)
    assert str(e.value) == (f"ds_config {section}.enabled=true needs the {module!r} package: "
                            f"{pip} (or set {section}.enabled=false)")
    assert asked == [module]


def test_installed_disabled_csv_and_torch_engine_pass():
    missing = lambda name: None                       # noqa: E731
    check_monitor_packages(_ds("deepspeed", {"wandb": {"enabled": False},
                                             "csv_monitor": {"enabled": True}}), missing)
    check_monitor_packages(_ds("malleus", {"tensorboard": {"enabled": True}}),
                           lambda name: object())
    # engine=torch builds no DeepSpeed monitor: its ds_config's monitors do not matter
    check_monitor_packages(_ds("torch", {"wandb": {"enabled": True}}), missing)


def test_validate_refuses_a_missing_monitor_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    for engine in ("deepspeed", "malleus"):
        with pytest.raises(ConfigError, match=r"ds_config wandb.enabled=true needs the 'wandb'"):
            runners.validate(_ds(engine, {"wandb": {"enabled": True}}))
