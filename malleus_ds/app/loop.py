"""Attaching the adaptive loop to a running MalleusEngine. The app does it, so the engine and
the loop import nothing from each other.

:func:`attach_loop` describes the engine's job in plain values (``adaptive.job.JobSpec``),
measures the TP slowdown table on the job's own device when asked (``engine/tp_cost.py``: a
collective, every rank calls it), hands the loop the engine's probe block
(``engine/probe_block.py``) and link probe (``engine/link_probe.py``), and attaches the loop
to the engine's step hooks (``steploop.py``). ``malleus_ds.initialize`` and the malleus
runner call it right after they build the engine, with the settings they parsed before it
(``AdaptiveSettings``, ``interop/malleus_section.py``).
"""
from __future__ import annotations


def job_spec(engine):
    """The engine's job as the loop plans for it: plain values, frozen now."""
    from ..adaptive.job import JobSpec

    p = engine.precision
    return JobSpec(rank=engine.global_rank, world=engine.world_size, job=engine.job,
                   param_table=engine.param_table, model_cfg=engine.model_cfg,
                   seq_len=engine.seq_len, micro_batch_size=engine.plan.micro_batch_size,
                   mixed=p.mixed, param_bytes=p.dtype.itemsize if p.mixed else 4,
                   zero_stage=engine.zero_stage, device=str(engine.device),
                   migrate_bucket_mb=engine.settings.migrate_bucket_mb,
                   recompute=bool(engine.settings.recompute),
                   device_mb=device_memory_mb(engine.device, engine.job.gpus_per_node))


def device_memory_mb(device: object, ranks_on_host: int) -> float:
    """Memory one rank may use: the GPU's, or on CPU this host's RAM shared by its ranks."""
    if device is not None and str(device).startswith("cuda"):
        import torch
        return torch.cuda.get_device_properties(device).total_memory / 2 ** 20
    from ..adaptive.replan import host_memory_mb

    return host_memory_mb(ranks_on_host)


def broadcast(obj: list) -> None:
    """Rank 0's ``obj[0]`` to every rank, in place (the loop's decisions), where a process
    group is up."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(obj, src=0)


def attach_loop(engine, settings):
    """Build the adaptive loop for ``engine`` under ``settings`` (``AdaptiveSettings``) and
    attach it; returns the loop. Collective when the TP slowdown is measured."""
    from ..adaptive.control import Controller
    from ..engine.link_probe import LinkProbe
    from ..engine.probe_block import ProbeBlock

    measured = None
    if settings.tp_slowdown == "measure" and engine.job.tp > 1:
        from ..engine.tp_cost import measure
        measured = measure(engine.model_cfg, engine.job.tp, engine.plan.micro_batch_size,
                           engine.seq_len, engine.device, engine.act_dtype)
    loop = Controller(job_spec(engine), settings, engine.plan, ProbeBlock(engine), measured,
                      link_prober=LinkProbe(engine), broadcast=broadcast)
    engine.attach_loop(loop)
    return loop
