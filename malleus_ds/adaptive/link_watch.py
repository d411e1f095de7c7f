"""The adaptive loop's view of the job's links (issue 35): timed communication -> link rates ->
detection -> the planning problem's ``link_rates`` and ``comm`` section.

Rank 0 of the loop (``control.py``) keeps one :class:`LinkWatch`:

1. **Readings.** Each step's timed communication (``StepSums.comm``: ``(kind, ranks, MB,
   seconds)`` per op, ``engine/comm_log.py``) goes to a
   :class:`~malleus_ds.adaptive.link_rates.LinkEstimator`, with the link rates the running
   plan was made for (its belief); no op is left out for a rank slow in compute (a
   reduction's reading holds no wait for a late peer, a probe runs after the step). Only the
   gradient reductions, the TP collectives and the link probes (``engine/link_probe.py``) are
   read
   (:data:`READ_KINDS`): a link held slow, which the plan made for it keeps the reductions
   off, is still probed, so its recovery is seen; a link neither crosses is not measured, and
   keeps the rate the plan was made for.
2. **Detection.** The node pairs' smoothed rates go through the same hysteresis as the ranks'
   (``detect.Detector``: healthy threshold, change, confirm, cooldown), with its own reference:
   the link rates the running plan was made for.
3. **The problem.** A re-plan for a slow link needs the costs of communication in model units:
   the ``comm`` section of ``cost.py``, measured here. ``layer_ms``: seconds per model unit
   (the loop's healthy pace, else its last calibration) x 1000; ``activation_mb``: one
   micro-batch's activations (micro-batch x sequence x hidden x the bytes of the trained
   dtype); ``grad_mb``: one decoder layer's fp32 gradients; ``inter_node_gbps`` and
   ``intra_node_gbps``: the healthy MB per second of the bucket reductions across and inside
   nodes (a ring member's share, ``comm_log.decode``), inside falling back to across where no
   reduction ran inside a node. Only a problem with some link believed slow gets the
   section: with every link healthy the loop plans as before, on compute alone.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from .detect import DetectConfig, Detector
from .link_rates import CommOp, Link, LinkEstimator

#: the kinds of timed communication links are read from: the gradient reductions, the TP
#: collectives (a TP group across nodes, summed over the step: the member whose peers were
#: never late) and the link probes. A pipeline
#: receive's wait is its peer's lateness (bubbles, a stage upstream) far more than its wire's
#: time: the least seconds per MB of a step's 4 KB receives, 4 ranks as 2 nodes of 2, ran
#: 5-680 ms/MB from step to step on a healthy link, and a plan that moved the boundary onto a
#: slow link read it as recovered. Receives are timed and logged; they are not evidence.
READ_KINDS = ("dp", "tp", "probe")


class LinkWatch:
    """Rank 0's link rates, their detection and the problem's link terms (module doc).
    ``job``: the loop's :class:`~malleus_ds.adaptive.job.JobSpec`; ``cfg``: the loop's
    detection settings."""

    def __init__(self, job, cfg: DetectConfig) -> None:
        self.spec = job
        layout = job.job
        n = layout.nodes
        self.links: list[Link] = [(a, b) for a in range(n) for b in range(a + 1, n)]
        self.healthy = cfg.healthy           # a rank's compute rate below it: healthy
        self.est = LinkEstimator(layout.node_of, window=cfg.window, healthy=cfg.link_healthy,
                                 recovery_kinds=("probe",))
        self.det = Detector(len(self.links), replace(cfg, healthy=cfg.link_healthy)) \
            if self.links else None
        self.comm: dict | None = None    # the comm section of the last request with slow links

    @property
    def active(self) -> bool:
        """Are there links to watch (a job on more than one node)?"""
        return self.det is not None

    def add(self, ops: Sequence[tuple]) -> None:
        """One step's timed communication (``StepSums.comm``)."""
        if not self.active:
            return
        kept = [CommOp(k, tuple(r), float(mb), float(s)) for k, r, mb, s in ops
                if k in READ_KINDS]
        # no op is left out for a rank slow in compute: a reduction
        # reads as its last-arriving member's wait, which holds no wait for a slow peer, and a
        # probe runs after the step. Leaving them out let a loaded host's misread compute
        # rates (1.5-1.7 on healthy ranks) hide a 15x slow link for 40 steps.
        self.est.add(kept, None, believed=self.planned())

    def measured(self) -> np.ndarray:
        """Per link (:attr:`links` order), its smoothed rate; NaN where not measured."""
        got = self.est.rates()
        if not got:              # nothing timed (a replay, the first steps): no list to build
            return np.full(len(self.links), np.nan)
        return np.array([got.get(ln, np.nan) for ln in self.links], dtype=float)

    def measured_map(self) -> dict[Link, float]:
        return {ln: round(float(v), 3) for ln, v in zip(self.links, self.measured())
                if not np.isnan(v)}

    def check(self) -> dict[Link, float] | None:
        """One detection: the normalised link rates to plan for (slow links only) when they
        moved from the planned ones, confirmed; else None. A link read slow is planned for at
        the higher of its window's median and its newer half's."""
        if not self.active:
            return None
        trig = self.det.check(self.measured())
        if trig is None:
            return None
        # where the links are heading: the median of the window's newer half. A link that
        # slows 30x reads through the window's median in a few steps, and planning for the
        # median's first 2.5 kept the plan, then cooled down: detected 9 steps after the onset
        recent = self.est.rates(last=self.det.cfg.window // 2 + 1)
        now = self.det.normalise([recent.get(ln, np.nan) for ln in self.links])
        return self._slow(np.maximum(np.asarray(trig.rates), now)
                          if any(r > 1.0 for r in trig.rates) else trig.rates)

    def normalised(self) -> dict[Link, float]:
        """Today's slow links as detection reads them (healthy -> gone, unmeasured -> planned)."""
        if not self.active:
            return {}
        return self._slow(self.det.normalise(self.measured()))

    def planned(self) -> dict[Link, float]:
        """The slow links the running plan was made for."""
        return self._slow(self.det.planned) if self.active else {}

    def planned_for(self, link_rates: Mapping[Link, float] | None) -> None:
        """After a planning attempt: the link rates it was made for (None: today's reading)."""
        if not self.active:
            return
        lr = self.normalised() if link_rates is None else dict(link_rates)
        self.det.planned_for([float(lr.get(ln, 1.0)) for ln in self.links])

    def _slow(self, rates) -> dict[Link, float]:
        return {ln: round(float(r), 3) for ln, r in zip(self.links, rates) if r > 1.0}

    def comm_section(self, seconds_per_unit: float | None) -> dict | None:
        """The problem's ``comm`` section as measured (module doc, 3), or None when a term is
        not known yet (no healthy pace or calibration, no op across nodes timed)."""
        spec = self.spec
        cfg = spec.model_cfg
        if not seconds_per_unit or seconds_per_unit <= 0 or cfg is None:
            return None

        def gbps(across: bool) -> float | None:
            spm = self.est.seconds_per_mb("dp", across)
            return 1.0 / (spm * 1e3) if spm else None        # MB per ms = GB/s
        inter = gbps(True)
        if inter is None:
            return None
        intra = gbps(False) or inter
        act_bytes = spec.param_bytes if spec.mixed else 4
        act_mb = spec.micro_batch_size * spec.seq_len * cfg.hidden_size * act_bytes / 1e6
        grad_mb = sum(int(np.prod(p.shape)) for p in spec.param_table.owned(0)) * 4 / 1e6
        return {"layer_ms": seconds_per_unit * 1e3, "activation_mb": act_mb,
                "intra_node_gbps": intra, "inter_node_gbps": inter, "grad_mb": grad_mb}

    def problem(self, pr, link_rates: Mapping[Link, float], comm: dict | None):
        """``pr`` with ``link_rates`` and, where some link is slow and ``comm`` is known, the
        measured ``comm`` section; ``pr`` as it is otherwise."""
        if not link_rates or comm is None:
            return pr
        extra = dict(pr.extra or {})
        extra["comm"] = dict(comm)
        return replace(pr, extra=extra).with_link_rates(dict(link_rates))
