"""The probe block: how a rank without work, or with only a light one, stays measured
(DESIGN.md §6, "Probes measure the device").

One decoder block's forward + backward on a dummy micro-batch, timed by the engine's compute
clock like training compute (so straggler emulation applies). The adaptive loop decides when a
rank probes and within what budget (``adaptive/probe.py``); the app hands the loop this block
(``app/loop.py``), which runs it on ranks without work, on held ranks and on the calibrating
rank, right after a step's all-reduce; the reading rides in the next step's all-reduce.
"""
from __future__ import annotations

import time

from ..steploop import REF_RUNS


class ProbeBlock:
    """The block (built on first use, fixed seed, the caller's RNG untouched) and its timing."""

    #: a rank without work keeps its probe busy this long before timing (seconds of wall): past
    #: one CPU-quota period (50 ms; a throttled process runs its period's share at full speed,
    #: so a short probe after idling reads healthy) and a GPU's clock ramp-up
    SUSTAIN_S = 0.06
    #: ...and then times repeats of the block over this long (spanning throttling periods)
    TIMED_S = 0.1
    #: ...and at least this long when it sustains (one CPU-quota period)
    MIN_TIMED_S = 0.05
    #: the calibrating rank (it works every step: warm) times this many runs, no warm-up after
    #: its first probe: the same cost as one warm-up and one timed run, half the timer noise
    REF_RUNS = REF_RUNS

    #: a sustained reading this many times its early one is a cap (a CPU quota, a power cap:
    #: the first milliseconds after idling run at full speed), and is reported instead. Below
    #: it the early reading stands: a process kept busy reads somewhat slow (well under
    #: CAP_SIGNAL) next to processes that wake from communication waits on an oversubscribed CPU (the scheduler favours the
    #: sleepers), and the reference, which times at the same moment, is not kept busy
    CAP_SIGNAL = 2.0

    def __init__(self, engine) -> None:
        self.engine = engine
        self.last: tuple[float, float | None] | None = None   # (early, sustained) s per run
        self.block = None
        self.x = None

    def measure(self, sustain: bool, budget_s: float) -> float:
        """Seconds of one decoder block's forward + backward on a dummy micro-batch, timed like
        training compute (straggler emulation applies). The block is built once (fixed seed,
        the caller's RNG untouched) and kept. It runs once untimed first (allocation, cold
        caches; the calibrating rank, which works every step, only on its first probe), then
        times :attr:`REF_RUNS` runs: the *early* reading, the same work at the same moment as
        the calibrating rank's probe, whose ratio to it is the rate
        (``rates.RateEstimator.add``). With ``sustain`` (a rank without work, or a held one)
        it then keeps the device busy for :attr:`SUSTAIN_S` and times the mean of repeats over
        :attr:`TIMED_S`, the *sustained* reading: a device that idled, or ran only short bursts,
        read as it works under full load (a CPU-quota-throttled process runs the first
        milliseconds of each period at full speed; a GPU ramps its clocks). The sustained
        reading is returned when it is over :attr:`CAP_SIGNAL` times the early one (a cap),
        else the faster of the two. All within ``budget_s`` (``adaptive/probe.py``, ``budget``),
        so the probe never delays the next all-reduce. ``self.last``: (early, sustained or None)."""
        import torch

        e = self.engine
        fresh = self.block is None
        if self.block is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                blk = e.model_cfg.build_layer(0, 0).to(device=e.device, dtype=e.act_dtype)
                x = torch.randn(e.plan.micro_batch_size, e.seq_len, e.model_cfg.hidden_size,
                                device=e.device, dtype=e.act_dtype)
            self.block, self.x = blk, x
        blk, cfg = self.block, e.model_cfg

        def run():
            x = self.x.detach().requires_grad_()
            cfg.run_block(blk, x, cfg.block_context(x)).float().sum().backward()

        def timed(reps: int) -> float:
            before = e.clock.compute_s
            e._timed(lambda: [run() for _ in range(reps)])
            return (e.clock.compute_s - before) / reps

        t0 = time.perf_counter()
        if sustain or fresh:
            run()                                      # warm-up, untimed
        runs = self.REF_RUNS
        if sustain and self.last is not None:          # a slow rank: fewer, within its budget
            runs = int(min(self.REF_RUNS, max(1, budget_s / 2 // max(self.last[0], 1e-6))))
        # the reference's shape, at the reference's moment: each run timed on its own, the
        # fastest kept (a block is a few ms on a small model: one preemption would double a run)
        early = min(timed(1) for _ in range(runs))
        sustained = None
        left = budget_s - (time.perf_counter() - t0)
        if sustain and left > 2 * early and self._can_be_capped():
            sustained = timed(self._sustain(run, left, early))
        for p in blk.parameters():
            p.grad = None
        self.last = (early, sustained)
        if sustained is None:
            return early
        if sustained > self.CAP_SIGNAL * early:
            return sustained                  # throttled under load (a cap): that is its rate
        # else the faster of the two: each carries the device's slowdown, and each has a bias
        # of its own on a shared host (early: caches and clocks cold after idling; sustained:
        # the scheduler favours the processes that wake from communication waits)
        return min(early, sustained)

    def release(self) -> None:
        """Free the block (back at full work: no probes for a while)."""
        self.block = None

    def _can_be_capped(self) -> bool:
        """Could this rank run under a throughput cap the sustained reading exists to see? Not
        when the straggler emulation slows it by sleeping (``straggler.method=sleep``): that
        slows every run alike, and on a shared CPU a sustained window then only adds noise (a
        heavily slowed rank's sustained reading can land anywhere from below to far above its
        early one, and a far-above one would be misread as a cap)."""
        st = getattr(getattr(self.engine, "clock", None), "straggler", None)
        return st is None or not st.schedule or getattr(st.schedule, "method", "sleep") != "sleep"

    def _sustain(self, run, budget: float, per_run: float = 0.0) -> int:
        """Run ``run`` back to back for the sustain time (bounded by the probe's budget); return
        how many repeats fill the timed window at the pace of the last one, or of ``per_run``
        seconds when slower (a timed run of a slowed rank: the straggler emulation sleeps in
        proportion to it, which the untimed runs here do not show)."""
        import torch

        dev = torch.device(self.engine.device)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        sustain = min(self.SUSTAIN_S, budget / 2)
        end, last = time.perf_counter() + sustain, 0.0
        while True:
            t0 = time.perf_counter()
            run()
            sync()
            last = time.perf_counter() - t0
            if time.perf_counter() >= end:
                break
        # at least one quota period (50 ms): a shorter window that starts in the throttled part
        # of a period (the sustain drained its share) reads a cap ~2x too slow
        window = max(self.MIN_TIMED_S, min(self.TIMED_S, budget / 2))
        return int(min(64, max(1, round(window / max(last, per_run, 1e-6)))))
