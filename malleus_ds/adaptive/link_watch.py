"""The adaptive loop's view of the job's links: timed communication -> link rates ->
detection -> the planning problem's ``link_rates``, ``gpu_link_rates`` and ``comm`` section.

Rank 0 of the loop (``control.py``) keeps one :class:`LinkWatch`, which watches two kinds of
link, each in a :class:`_Scope` of its own: the links between nodes (node pairs), and the links
between the GPUs of one node (rank pairs, ``detect.gpu_links``: a degraded NVLink or PCIe path,
which the TP collectives cross on every layer). The second reads only the TP collectives and
probes whose ranks all sit in one node (:data:`GPU_READ_KINDS`), with each rank its own end. Their readings come out together as
:class:`Links` (node links, GPU links).

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
2. **Detection.** The links' smoothed rates go through the same hysteresis as the ranks'
   (``detect.Detector``, one per scope: healthy threshold, change, confirm, cooldown), with its
   own reference: the link rates the running plan was made for.
3. **The problem.** A re-plan for a slow link needs the costs of communication in model units:
   the ``comm`` section of ``cost.py``, measured here. ``layer_ms``: seconds per model unit
   (the loop's healthy pace, else its last calibration) x 1000; ``activation_mb``: one
   micro-batch's activations (micro-batch x sequence x hidden x the bytes of the trained
   dtype); ``grad_mb``: one decoder layer's fp32 gradients; ``inter_node_gbps`` and
   ``intra_node_gbps``: the healthy MB per second of the bucket reductions across and inside
   nodes (a ring member's share, ``comm_log.decode``), inside falling back to the TP
   collectives' and then to across, and across to inside in a one-node job. Only a problem with
   some link believed slow gets the section: with every link healthy the loop plans as before,
   on compute alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from .detect import DetectConfig, Detector
from .link_rates import CommOp, Link, LinkEstimator

#: the kinds of timed communication links are read from: the gradient reductions, the TP
#: collectives (a TP group across nodes, summed over the step: the member whose peers were
#: never late) and the link probes. A pipeline
#: receive's wait is its peer's lateness (bubbles, a stage upstream) far more than its wire's
#: time: even the least seconds per MB of a step's small receives swings by orders of
#: magnitude from step to step on a healthy link, and a plan that moved the boundary onto a
#: slow link would read it as recovered. Receives are timed and logged; they are not evidence.
READ_KINDS = ("dp", "tp", "probe")
#: ...and the kinds the links between a node's GPUs are read from: the TP collectives (a
#: step's quickest of many) and the probes (the quickest of three). A reduction inside a node
#: is one wait a step: on a loaded host it reads several times slow on a healthy link and
#: would set off re-plans for nothing
GPU_READ_KINDS = ("tp", "probe")


@dataclass(frozen=True)
class Links:
    """Link rates of both kinds: ``nodes`` (node pair -> rate) and ``gpus`` (a pair of ranks of
    one node -> rate)."""

    nodes: Mapping[Link, float] = field(default_factory=dict)
    gpus: Mapping[Link, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.gpus)

    def keys(self) -> set:
        """Every link named, tagged by its kind (to compare two sets of links)."""
        return {("node", *k) for k in self.nodes} | {("gpu", *k) for k in self.gpus}

    def items(self) -> list[tuple[str, Link, float]]:
        """``(kind, link, rate)`` of every link named, in order: node links, then GPU links."""
        return ([("node", k, v) for k, v in sorted(self.nodes.items())]
                + [("gpu", k, v) for k, v in sorted(self.gpus.items())])

    def json(self) -> dict:
        """The event's form: ``{"link_rates": {"a-b": r}}``, plus ``"gpu_link_rates"`` where a
        GPU link is named (``Problem``'s keys)."""
        out = {"link_rates": _json(self.nodes)}
        if self.gpus:
            out["gpu_link_rates"] = _json(self.gpus)
        return out

    @staticmethod
    def from_json(node_rates, gpu_rates=None) -> "Links":
        """From an event's ``link_rates`` and ``gpu_link_rates`` (``{"a-b": r}``)."""
        def parse(d):
            return {tuple(int(x) for x in k.split("-")): float(v) for k, v in (d or {}).items()}
        return Links(parse(node_rates), parse(gpu_rates))

    def text(self) -> str:
        parts = [f"{a}-{b} x{r:g}" for (a, b), r in sorted(self.nodes.items())]
        parts += [f"GPUs {a}-{b} x{r:g}" for (a, b), r in sorted(self.gpus.items())]
        return ", ".join(parts)


def _json(links: Mapping[Link, float]) -> dict[str, float]:
    return {f"{a}-{b}": float(r) for (a, b), r in sorted(links.items())}


class _Scope:
    """One kind of link: its links, estimator and detection. ``ends``: rank -> the end an op's
    rank stands for (its node, or itself); ``keep``: which ops (:class:`CommOp`) speak for
    these links."""

    def __init__(self, links: list[Link], ends, keep, cfg: DetectConfig) -> None:
        self.links, self.keep = links, keep
        self.est = LinkEstimator(ends, window=cfg.window, healthy=cfg.link_healthy,
                                 recovery_kinds=("probe",))
        self.det = Detector(len(links), replace(cfg, healthy=cfg.link_healthy)) \
            if links else None

    def measured(self) -> np.ndarray:
        got = self.est.rates()
        if not got:              # nothing timed (a replay, the first steps): no list to build
            return np.full(len(self.links), np.nan)
        return np.array([got.get(ln, np.nan) for ln in self.links], dtype=float)

    def slow(self, rates) -> dict[Link, float]:
        return {ln: round(float(r), 3) for ln, r in zip(self.links, rates) if r > 1.0}

    def check(self) -> dict[Link, float] | None:
        """One detection (:meth:`LinkWatch.check`)."""
        trig = self.det.check(self.measured())
        if trig is None:
            return None
        # where the links are heading: the median of the window's newer half. A link that
        # slows sharply climbs through the window's median over a few steps; planning for the
        # median's first, low reading would keep the plan and then cool down, so the real
        # slowdown would be acted on many steps after its onset
        recent = self.est.rates(last=self.det.cfg.window // 2 + 1)
        now = self.det.normalise([recent.get(ln, np.nan) for ln in self.links])
        return self.slow(np.maximum(np.asarray(trig.rates), now)
                         if any(r > 1.0 for r in trig.rates) else trig.rates)


def watches_gpu_links(cfg: DetectConfig, layout) -> bool:
    """Are the links between a node's GPUs read (``detect.gpu_links``; None: where the job's
    nominal TP degree is above 1)? Only where a node holds two or more of the job's ranks."""
    on = cfg.gpu_links if cfg.gpu_links is not None else layout.tp > 1
    return bool(on) and layout.gpus_per_node > 1


class LinkWatch:
    """Rank 0's link rates, their detection and the problem's link terms (module doc).
    ``job``: the loop's :class:`~malleus_ds.adaptive.job.JobSpec`; ``cfg``: the loop's
    detection settings."""

    def __init__(self, job, cfg: DetectConfig) -> None:
        self.spec = job
        layout = job.job
        n = layout.nodes
        self.node = _Scope([(a, b) for a in range(n) for b in range(a + 1, n)],
                           layout.node_of, lambda op: True, cfg)
        pairs = [(r, s) for k in range(n) for i, r in enumerate(layout.node_ranks(k))
                 for s in layout.node_ranks(k)[i + 1:]] if watches_gpu_links(cfg, layout) else []
        self.gpu = _Scope(pairs, lambda r: r,
                          lambda op: op.kind in GPU_READ_KINDS
                          and len({layout.node_of(r) for r in op.ranks}) == 1, cfg)
        self.scopes = (self.node, self.gpu)
        self.comm: dict | None = None    # the comm section of the last request with slow links

    @property
    def links(self) -> list[Link]:
        """The node links (node pairs)."""
        return self.node.links

    @property
    def active(self) -> bool:
        """Are there links to watch (a job on more than one node, or a node with two or more
        of the job's ranks and ``detect.gpu_links``)?"""
        return any(sc.det is not None for sc in self.scopes)

    def add(self, ops: Sequence[tuple]) -> None:
        """One step's timed communication (``StepSums.comm``)."""
        if not self.active:
            return
        kept = [CommOp(k, tuple(r), float(mb), float(s)) for k, r, mb, s in ops
                if k in READ_KINDS]
        # no op is left out for a rank slow in compute: a reduction
        # reads as its last-arriving member's wait, which holds no wait for a slow peer, and a
        # probe runs after the step. Leaving them out would let a loaded host's misread
        # compute rates (healthy ranks read somewhat slow) hide a slow link for many steps.
        planned = self.planned()
        for sc, believed in ((self.node, planned.nodes), (self.gpu, planned.gpus)):
            if sc.det is not None:
                sc.est.add([op for op in kept if sc.keep(op)], None, believed=believed)

    def measured(self) -> np.ndarray:
        """Per node link (:attr:`links` order), its smoothed rate; NaN where not measured."""
        return self.node.measured()

    def measured_map(self) -> Links:
        def one(sc):
            return {ln: round(float(v), 3) for ln, v in zip(sc.links, sc.measured())
                    if not np.isnan(v)}
        return Links(one(self.node), one(self.gpu))

    def check(self) -> Links | None:
        """One detection: the normalised link rates to plan for (slow links only) when they
        moved from the planned ones, confirmed, in either scope (the other then keeps what it
        was planned for); else None. A link read slow is planned for at the higher of its
        window's median and its newer half's."""
        got = [sc.check() if sc.det is not None else None for sc in self.scopes]
        if all(g is None for g in got):
            return None
        planned = self.planned()
        return Links(planned.nodes if got[0] is None else got[0],
                     planned.gpus if got[1] is None else got[1])

    def normalised(self) -> Links:
        """Today's slow links as detection reads them (healthy -> gone, unmeasured -> planned)."""
        return Links(*(sc.slow(sc.det.normalise(sc.measured())) if sc.det is not None else {}
                       for sc in self.scopes))

    def planned(self) -> Links:
        """The slow links the running plan was made for."""
        return Links(*(sc.slow(sc.det.planned) if sc.det is not None else {}
                       for sc in self.scopes))

    def planned_for(self, links: Links | None) -> None:
        """After a planning attempt: the link rates it was made for (None: today's reading)."""
        lr = self.normalised() if links is None else links
        for sc, got in zip(self.scopes, (lr.nodes, lr.gpus)):
            if sc.det is not None:
                sc.det.planned_for([float(got.get(ln, 1.0)) for ln in sc.links])

    def state(self) -> tuple | None:
        """What a further identical step could change (``Controller.steady_key``), or None while
        a detection streak or cooldown runs."""
        out = []
        for sc in self.scopes:
            d = sc.det
            if d is None:
                continue
            if d.streak or d.cooldown:
                return None
            out.append((d.planned.tobytes(), sc.measured().tobytes()))
        return tuple(out)

    def comm_section(self, seconds_per_unit: float | None) -> dict | None:
        """The problem's ``comm`` section as measured (module doc, 3), or None when a term is
        not known yet (no healthy pace or calibration, no op timed)."""
        spec = self.spec
        cfg = spec.model_cfg
        if not seconds_per_unit or seconds_per_unit <= 0 or cfg is None:
            return None

        def gbps(est, kind, across: bool) -> float | None:
            spm = est.seconds_per_mb(kind, across)
            return 1.0 / (spm * 1e3) if spm else None        # MB per ms = GB/s
        inter = gbps(self.node.est, "dp", True)
        # inside a node: the reductions there, else the TP collectives (the GPU scope's ops
        # cross a pair of ranks: "across" in its terms)
        intra = gbps(self.node.est, "dp", False) or gbps(self.gpu.est, "tp", True)
        if inter is None and intra is None:
            return None
        inter, intra = inter or intra, intra or inter
        act_bytes = spec.param_bytes if spec.mixed else 4
        act_mb = spec.micro_batch_size * spec.seq_len * cfg.hidden_size * act_bytes / 1e6
        grad_mb = sum(int(np.prod(p.shape)) for p in spec.param_table.owned(0)) * 4 / 1e6
        return {"layer_ms": seconds_per_unit * 1e3, "activation_mb": act_mb,
                "intra_node_gbps": intra, "inter_node_gbps": inter, "grad_mb": grad_mb}

    def problem(self, pr, links: Links, comm: dict | None):
        """``pr`` with ``links`` and, where some link is slow and ``comm`` is known, the
        measured ``comm`` section; ``pr`` as it is otherwise."""
        if not links or comm is None:
            return pr
        extra = dict(pr.extra or {})
        extra["comm"] = dict(comm)
        return replace(pr, extra=extra).with_link_rates(dict(links.nodes), dict(links.gpus))
