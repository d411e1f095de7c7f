"""launch/summarize.py on bad input: one line on stderr, exit 2, naming the file and line (run as a
command)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path



REPO = Path(__file__).resolve().parents[2]
SUMMARIZE = REPO / "launch" / "summarize.py"


def _summarize(*args):
    return subprocess.run([sys.executable, str(SUMMARIZE), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def _step(step, t=0.5):
    return json.dumps({"step": step, "step_time_s": t, "samples": 8, "loss": 1.0})


def test_summarize_missing_folder(tmp_path):
    p = _summarize(tmp_path / "nope")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"summarize: {tmp_path / 'nope'}: no such folder"


def test_summarize_corrupt_metrics_names_file_and_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(_step(0) + "\n" + _step(1) + "\n" + '{"step": 2, "st')
    p = _summarize(run)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"summarize: {run / 'metrics.jsonl'}: line 3 is not valid JSON")


def test_summarize_step_line_without_fields(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(_step(0) + "\n" + json.dumps({"step": 1}) + "\n")
    p = _summarize(run)
    assert p.returncode == 2
    assert "line 2 is a step line without ['step_time_s', 'samples']" in p.stderr


def test_summarize_a_file_that_is_no_folder(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("hi")
    p = _summarize(f)
    assert p.returncode == 2 and f"summarize: {f}: not a folder" in p.stderr


def test_summarize_good_run_and_event_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ev = json.dumps({"event": "switch", "step": 1})
    (run / "metrics.jsonl").write_text("\n".join([_step(0), _step(1), ev, _step(2), ""]))
    p = _summarize(run)
    assert p.returncode == 0, p.stderr
    assert "16.0" in p.stdout and "1.00x" in p.stdout      # 8 samples / 0.5 s
    p = _summarize(run / "metrics.jsonl")                    # the file itself works too
    assert p.returncode == 0, p.stderr
