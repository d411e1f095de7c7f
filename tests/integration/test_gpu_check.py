"""scripts/gpu_check.py --cpu-dry-run (the plumbing of the one prepared GPU check, on CPU) and
scripts/gpu_check.sh's contract with scripts/setup.sh.

The dry run runs every part that can run on CPU in a subprocess; its report must have every
section, numbers that parse, real PASS rows for what the CPU measures (the Triton kernel under
the interpreter against the torch twin, warm_up a no-op, a gloo 1-rank malleus run) and
"not measured (no GPU)" for every GPU-only number.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: the dry run (a process per part) takes 20 s or more on 2 cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
NO_GPU = "not measured (no GPU)"


def _sections(text: str) -> dict[str, list[list[str]]]:
    """{section title: table rows as cell lists} of the markdown report."""
    out: dict[str, list[list[str]]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("### "):
            cur = out.setdefault(line[4:], [])
        elif cur is not None and line.startswith("| ") and not line.startswith("| what") \
                and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 5, line
            cur.append(cells)
    return out


@pytest.fixture(scope="module")
def dry_run() -> tuple[int, str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout, p.stderr


def test_dry_run_report(dry_run):
    rc, out, err = dry_run
    assert rc == 0, out[-3000:] + err[-3000:]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_check import SECTIONS
    finally:
        sys.path.pop(0)
    secs = _sections(out)
    assert list(secs) == list(SECTIONS.values())
    for title, rows in secs.items():
        assert rows, f"section {title!r} has no rows"
        for what, number, unit, target, result in rows:
            assert result in ("PASS", NO_GPU), (title, what, result)
            assert target, (title, what)
            if result == NO_GPU:
                assert number == "—", (title, what, number)
            else:
                float(number)                       # a measured number parses
    by = {t.split(". ", 1)[1]: rows for t, rows in secs.items()}
    triton = by["Triton pack/unpack against the torch twin"]
    # 3 dtypes x aligned / unaligned / transposed, all measured on CPU under the interpreter
    assert len(triton) == 9 and all(r[4] == "PASS" and r[1] == "0" for r in triton)
    for key in ("A window over 2^31 elements", "Pack bandwidth (bench/bench_pack.py)",
                "Several GPUs", "Communication timed by CUDA events (link rates)"):
        assert all(r[4] == NO_GPU for r in by[key]), key
    compile_ = by["First-call compile and the start-up warm-up"]
    assert [r[4] for r in compile_] == [NO_GPU] * 4 + ["PASS"]
    malleus = by["1-rank engine=malleus, bf16"]
    assert [r[4] for r in malleus] == ["PASS", "PASS", NO_GPU, NO_GPU]
    assert "['bfloat16', 'float32']" in malleus[1][0]      # warm_up saw the job's dtypes
    trainer = by["1-GPU Hugging Face Trainer: MalleusTrainer against the stock one, ZeRO-3"]
    assert [r[4] for r in trainer] == ["PASS", NO_GPU]
    m = re.search(r"\*\*Summary: (\d+) PASS, 0 FAIL, (\d+) not measured", out)
    assert m and int(m.group(1)) == 13, out[-500:]


def test_without_gpu_or_dry_run_it_refuses():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and "--cpu-dry-run" in p.stderr


def test_bad_flags_name_the_field():
    p = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--only", "triton,nope"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--only: unknown parts ['nope']" in p.stderr
    p = subprocess.run([sys.executable, str(SCRIPT), "--multi-cpu-ranks", "9"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--multi-cpu-ranks=9" in p.stderr


def test_shell_script_stamp_matches_setup():
    # gpu_check.sh writes setup.sh's install stamp after building a GPU .venv, so that sourcing
    # setup.sh does not reinstall the CPU wheel: both must compute it the same way
    formula = "cat setup.py constraints-cpu.txt | sha256sum | cut -d' ' -f1"
    assert formula in (ROOT / "scripts" / "setup.sh").read_text()
    sh = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert f"{formula} > .venv/.malleus_install_stamp" in sh
    assert sh.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in sh
    assert 'tee "$OUT/gpu_report.md"' in sh
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
