"""What a switch and a restart cost a replayed job, term by term, each number with its source.

**A live switch** (the ``malleus`` policy) pauses the job at a step boundary for what the
engine pays for it, term by term (each measured: bench/RESULTS.md, session 33):

1. ``transfer``: the real transfer plan of the switch (``migrate/transfer.py``: who sends which
   slice to whom; every byte a GPU newly holds arrives once, the lower bound). Each GPU sends
   and receives its part over its own links at once, so the transfer takes the slowest GPU's
   ``max(sent, received)`` over the inter-node network plus ``max(sent, received)`` over
   NVLink to GPUs of its own node; a switch that moves no bytes (one that only re-splits the
   micro-batches) has none;
2. ``communicators``: creating process groups (NCCL communicators), charged only where the
   new plan needs rank sets the job does not hold: the engine caches its groups by rank set
   and keeps those of its recent layouts (``migrate/group_sets.py``; the replay follows the same rule
   with ``migrate/group_sets.GroupMirror`` and passes what it holds as ``held``), so a re-split or a
   switch back to a recent layout creates none;
3. ``warmup``: the first step under the new plan, slower than the next ones (its buffers
   allocated and first touched, new shapes met; up to 1.5x on our engine,
   ``adaptive/pace_check.py``), charged as ``warmup_steps`` of its step time where buffers
   change: some rank holds another stage (layers, TP group) or the stages' rank sets differ
   (gradient buckets and ZeRO partitions follow them). A switch that keeps every pipeline's
   stages and changes only micro-batch counts (:func:`keeps_buffers`) runs the same kernels
   on the same shapes in the same buffers, and is charged ``warmup_kept_steps`` (0: measured
   on the engine, session 33);
4. ``fixed``: what every switch costs besides (validation, the runtime's rebuild, the
   agreement), ``fixed_s``: 0 at cluster scale (not measured there; on 4 CPU ranks a switch
   that moves nothing pauses for a few tens of milliseconds, session 33); a ``--from-run``
   replay fits it to the run's own switches (``run_costs.py``).

The decision's broadcast rides in a step's all-reduce and costs nothing measurable.

**A restart** (the ``restart`` policy) stops the job and starts it again under the new plan:
checkpoint save, conversion to a layout-free (universal) checkpoint, process-group start-up,
checkpoint load into the new layout. Relaunching the processes and building the model are not
counted (we found no published figure): the restart's cost is a lower bound.

Sources are in ``docs/TRACES.md`` ("Switch and restart costs") next to each number; both are
overridable (``--switch-costs``, ``--restart-costs``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import Plan, same_stages
from ..migrate.group_sets import plan_rank_sets


def keeps_buffers(old: Plan, new: Plan) -> bool:
    """Does the switch ``old`` -> ``new`` keep every rank's buffers (module doc, term 3): the
    same pipelines' stages (layers and ranks, pipelines in any order), only micro-batch counts
    changed (``plan.same_stages``)?"""
    return same_stages(old, new)


@dataclass(frozen=True)
class Migration:
    """One switch: network bytes, seconds the job waits, and the seconds of each term."""

    bytes: int
    seconds: float
    terms: dict = field(default_factory=dict)


def _parse(cls, text: str, flag: str):
    """``key=value,key=value`` of ``cls``'s fields (numbers) over its defaults; ValueError
    naming the flag, the key and the value."""
    kw = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, eq, v = part.partition("=")
        k = k.strip()
        if not eq or k not in cls.__dataclass_fields__:
            raise ValueError(f"{flag}: {part!r} is not key=value with a key of "
                             f"{', '.join(cls.__dataclass_fields__)}")
        try:
            kw[k] = float(v)
        except ValueError:
            raise ValueError(f"{flag}: {k}={v.strip()!r} is not a number") from None
    out = cls(**kw)
    out.check(flag)
    return out


@dataclass(frozen=True)
class MigrationCost:
    """Per-GPU link bandwidths (GB/s, one direction) and the fixed costs of a live switch.
    Defaults: measured on DGX/HGX H100 (docs/TRACES.md); H200 has the same NVLink 4 and
    ConnectX-7 NDR network, so the same figures."""

    network_gbps: float = 48.0      # one 400 Gb/s NDR NIC per GPU: 46-49 GB/s achieved
    nvlink_gbps: float = 370.0      # NCCL's effective NVLink 4 bandwidth per GPU
    communicators_s: float = 5.0    # new process groups, where any (MegaScale, 2,048 GPUs)
    warmup_steps: float = 0.5       # the first step after a switch runs up to 1.5x its time
    warmup_kept_steps: float = 0.0  # ...after one that keeps every buffer (a re-split)
    fixed_s: float = 0.0            # every switch (a --from-run replay fits it)

    def check(self, flag: str = "--switch-costs") -> None:
        rules = (("network_gbps", self.network_gbps > 0, "> 0 (GB/s)"),
                 ("nvlink_gbps", self.nvlink_gbps > 0, "> 0 (GB/s)"),
                 ("communicators_s", self.communicators_s >= 0, ">= 0 (seconds)"),
                 ("warmup_steps", self.warmup_steps >= 0, ">= 0 (steps)"),
                 ("warmup_kept_steps", self.warmup_kept_steps >= 0, ">= 0 (steps)"),
                 ("fixed_s", self.fixed_s >= 0, ">= 0 (seconds)"))
        for name, ok, need in rules:
            if not ok:     # NaN fails every comparison
                raise ValueError(f"{flag}: {name}={getattr(self, name)!r} must be {need}")

    @staticmethod
    def parse(text: str) -> "MigrationCost":
        return _parse(MigrationCost, text, "--switch-costs")

    def of_switch(self, spec, old: Plan, new: Plan, new_step_s: float,
                  held=None) -> Migration:
        """The switch from ``old`` to ``new`` of the job ``spec`` (a ``JobSpec``), whose first
        step under ``new`` takes ``new_step_s`` seconds. ``held``: the rank sets whose groups
        the job holds at the switch (``GroupMirror.live``; None: ``old``'s only)."""
        from ..migrate.transfer import Layout, transfer_plan

        tp = transfer_plan(Layout(old, spec.zero_stage), Layout(new, spec.zero_stage),
                           spec.param_table, mixed=spec.mixed, param_bytes=spec.param_bytes,
                           job=spec.job)
        n = spec.world
        sent = [[0, 0] for _ in range(n)]        # per rank: (inter-node, intra-node) bytes
        recv = [[0, 0] for _ in range(n)]
        for t in tp.transfers:
            b = tp.bytes_of(t)
            k = 1 if spec.job.same_node(t.src, t.dst) else 0
            sent[t.src][k] += b
            recv[t.dst][k] += b
        net = self.network_gbps * 1e9
        nvl = self.nvlink_gbps * 1e9
        transfer = max((max(sent[r][0], recv[r][0]) / net + max(sent[r][1], recv[r][1]) / nvl
                        for r in range(n)), default=0.0)
        if held is None:
            held = plan_rank_sets(old, n)
        new_sets = set(plan_rank_sets(new, n)) - set(held)
        comm = self.communicators_s if new_sets else 0.0
        kept = keeps_buffers(old, new)
        warm = (self.warmup_kept_steps if kept else self.warmup_steps) * new_step_s
        terms = {"transfer_s": round(transfer, 4), "communicators_s": comm,
                 "warmup_s": round(warm, 4), "fixed_s": self.fixed_s,
                 "new_groups": len(new_sets), "buffers_kept": kept}
        return Migration(tp.bytes, transfer + comm + warm + self.fixed_s, terms)


@dataclass(frozen=True)
class RestartCost:
    """The seconds a save-restart-reload into a new plan takes, by term. Defaults: DeepSpeed's
    Universal Checkpointing (ATC'25, Table 3: BLOOM-176B on 48 A100 nodes) for save, transform
    and load, and NVIDIA's report of NCCL start-up at scale (docs/TRACES.md)."""

    save_s: float = 29.0            # 0.48 min
    transform_s: float = 100.0      # ds_to_universal: 1.67 min
    init_s: float = 150.0           # NCCL start-up "above certain K GPUs": 2.5 min
    load_s: float = 41.0            # 0.68 min

    def check(self, flag: str = "--restart-costs") -> None:
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"{flag}: {name}={v!r} must be >= 0 (seconds)")

    @staticmethod
    def parse(text: str) -> "RestartCost":
        return _parse(RestartCost, text, "--restart-costs")

    @property
    def seconds(self) -> float:
        return self.save_s + self.transform_s + self.init_s + self.load_s

    def terms(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
