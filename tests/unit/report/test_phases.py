"""malleus_ds/report/phases.py: a run's straggler phases from its measured rates, read as the adaptive
loop reads them, and every report that splits by measured rates (what-if account,
launch/summarize.py, the compare report's what-if lines, malleus-plot's data) reading them so:
per-step noise on a healthy run makes no straggler phase (issue 31)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from malleus_ds.report import compare, plot_data
from malleus_ds.report.phases import HEALTHY, MIN_STEPS, WINDOW, centred_median, rate_phases
from malleus_ds.adaptive.detect import DetectConfig
from malleus_ds.report.whatif import Layout, account, closing_line, format_account

REPO = Path(__file__).resolve().parents[3]

#: the noise a healthy 2-rank DeepSpeed run on a shared CPU host showed (8 steps): one step each
#: with rank 0 at 1.27, rank 0 at 1.57, rank 1 at 1.91, the other steps at about 1.0
SPIKES = {2: (0, 1.27), 4: (0, 1.57), 6: (1, 1.91)}


def noisy_healthy(steps: int = 8, spikes=SPIKES, measured: bool = False) -> list[dict]:
    """A healthy 2-rank run's step lines: compute_s ~25 ms with 2% jitter, plus ``spikes``
    (step: (rank, rate)), each one step long. ``measured``: engine=malleus lines, whose
    ``measured_rates`` carry the same readings (null at first)."""
    rng = np.random.default_rng(1)
    out = []
    for s in range(steps):
        c = [0.025 * (1 + 0.02 * rng.random()), 0.025 * (1 + 0.02 * rng.random())]
        if s in spikes:
            d, x = spikes[s]
            c[d] = c[1 - d] * x
        rec = {"step": s, "loss": 5.0, "samples": 8, "step_time_s": max(c) + 0.01,
               "compute_s": c, "emulated_s": [0.0, 0.0], "emulated_rates": {}}
        if measured:
            rec["plan"] = "plan-a"
            rec["measured_rates"] = [None, None] if s < 1 else [round(x / min(c), 3) for x in c]
        out.append(rec)
    return out


def straggler_run(steps: int = 40, onset: int = 10, length: int = 15, rate: float = 3.0,
                  spike: dict[int, float] | None = None) -> list[dict]:
    """Rank 1 really slow (``rate``) in steps ``onset .. onset+length-1``; ``spike``: step ->
    rank 1's reading that one step instead."""
    out = []
    for s in range(steps):
        x = rate if onset <= s < onset + length else 1.0
        x = (spike or {}).get(s, x)
        c = [0.1, 0.1 * x]
        out.append({"step": s, "samples": 8, "step_time_s": max(c) + 0.05, "compute_s": c,
                    "emulated_rates": {}})
    return out


def readings(recs):
    return [int(r["step"]) for r in recs], [r["compute_s"] and
                                            [x / min(r["compute_s"]) for x in r["compute_s"]]
                                            for r in recs]


def test_the_constants_are_the_loops():
    cfg = DetectConfig()
    assert WINDOW == cfg.window == 5 and HEALTHY == cfg.healthy == 1.2
    assert MIN_STEPS == cfg.window + cfg.confirm == 7


def test_centred_median_keeps_a_step_change_and_drops_spikes():
    y = [1, 9, 1, 1, 1, 1, 3, 3, 3, 9, 3, 3]
    assert centred_median(y).tolist() == [1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3]
    # near the ends the window shrinks on both sides: the last value is its own median
    np.testing.assert_array_equal(centred_median([np.nan, 2.0, np.nan, 4.0]),
                                  [np.nan, 2.0, 3.0, 4.0])
    assert centred_median([]).size == 0


def test_noise_of_a_healthy_run_is_no_phase():
    steps, rates = readings(noisy_healthy())
    assert [(p.first, p.last, p.rates) for p in rate_phases(steps, rates)] == [(0, 7, ())]
    # a burst of 3 steps on one rank (longer than the median removes) is still too short
    steps, rates = readings(noisy_healthy(20, {8: (1, 1.5), 9: (1, 1.8), 10: (1, 1.6)}))
    assert [p.rates for p in rate_phases(steps, rates)] == [()]


@pytest.mark.parametrize("measured", [False, True], ids=["compute_s", "measured_rates"])
def test_whatif_of_a_noisy_healthy_run_says_no_straggler(measured):
    recs = noisy_healthy(measured=measured)
    a = account(recs, [], Layout(1, 1, 2, 1, 8, 1), warmup=1)
    assert a.rate_source == ("measured" if measured else "compute_s")
    assert not a.stragglers and [p.rates for p in a.phases] == [()]
    assert (a.x, a.y, a.z) == (0, 0, 0)
    assert closing_line(a).startswith("no straggler in this run")
    assert format_account(a) == ("  what-if: no straggler in this run: nothing for a re-layout "
                                 "to win back (7 steps after the warm-up)")


def test_a_real_straggler_is_one_phase_with_its_steps_and_rate():
    steps, rates = readings(straggler_run())
    ph = rate_phases(steps, rates)
    assert [(p.first, p.last, p.rates) for p in ph] == [
        (0, 9, ()), (10, 24, ((1, 3.0),)), (25, 39, ())]
    assert [(p.lo, p.hi, p.steps) for p in ph] == [(0, 10, 10), (10, 25, 15), (25, 40, 15)]
    a = account(straggler_run(), [], None, warmup=1)
    assert [(p.first, p.last, p.rates) for p in a.phases] == [
        (1, 9, ()), (10, 24, ((1, 3.0),)), (25, 39, ())]
    assert a.stragglers and a.x > 0


@pytest.mark.parametrize("spike", [{17: 1.0}, {17: 9.0}, {16: 1.0, 17: 1.0}, {14: 1.1, 20: 1.0}],
                         ids=["dip", "peak", "two-step-dip", "two-dips"])
def test_a_spike_inside_a_real_phase_does_not_split_it(spike):
    steps, rates = readings(straggler_run(spike=spike))
    ph = rate_phases(steps, rates)
    assert [(p.first, p.last, p.rates) for p in ph] == [
        (0, 9, ()), (10, 24, ((1, 3.0),)), (25, 39, ())]
    a = account(straggler_run(spike=spike), [], None, warmup=1)
    assert [p.rates for p in a.phases if p.rates] == [((1, 3.0),)]


def test_a_straggler_shorter_than_the_loop_can_confirm_is_no_phase():
    for length, phases in ((MIN_STEPS - 1, 1), (MIN_STEPS, 3)):
        steps, rates = readings(straggler_run(length=length))
        ph = rate_phases(steps, rates)
        assert len(ph) == phases, (length, ph)
    # a straggler from the first step on lasting the whole (long enough) run is one phase
    steps, rates = readings(straggler_run(steps=12, onset=0, length=12))
    assert [(p.first, p.last, p.rates) for p in rate_phases(steps, rates)] == \
        [(0, 11, ((1, 3.0),))]


def test_missing_readings_and_bad_input():
    # null readings (not measured yet) are healthy; a row without rates too
    assert [p.rates for p in rate_phases([0, 1, 2], [[None, None], None, [1.0, 5.0]])] == [()]
    assert rate_phases([], []) == []
    with pytest.raises(ValueError, match="2 steps but 1 rows"):
        rate_phases([0, 1], [[1.0]])


def _write(d: Path, recs: list[dict]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_every_reader_of_a_noisy_healthy_run_says_no_straggler(tmp_path, capsys):
    """launch/summarize.py (the README's sweep), the compare report's what-if lines and
    malleus-plot's data, on the noisy healthy DeepSpeed run and a noisy healthy Malleus run."""
    run = _write(tmp_path / "s" / "0", noisy_healthy())
    _write(tmp_path / "s" / "1", noisy_healthy(measured=True))
    spec = importlib.util.spec_from_file_location("summarize", REPO / "launch" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert out.count("no straggler in this run") == 2, out
    assert "stragglers would have cost" not in out and "rank 0 at rate" not in out
    lines = compare.whatif_lines(tmp_path / "s", ["0", "1"], 1)
    assert lines.count("no straggler in this run") == 2, lines
    data = plot_data.load_run_data(run)
    assert data.whatif is not None and not data.whatif.stragglers
