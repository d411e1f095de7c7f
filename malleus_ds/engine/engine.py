"""MalleusEngine: a DeepSpeed engine that runs any valid plan with the math of one process.

How it sits on ``DeepSpeedEngine`` (read ``deepspeed/runtime/engine.py`` before changing this):
the base ``__init__`` assumes one data-parallel group for the whole model (it broadcasts every
parameter over it, builds one ZeRO optimizer over it, sizes batches by it). In a Malleus plan every
*layer* has its own replica set, and with different TP sizes every *finest shard* has its own.
So we hand the base engine a plan-aware ``mpu`` whose data-parallel group is this rank alone, the
stage module (already TP-sharded) as its model, and a config with ``optimizer`` and
``zero_optimization`` taken out. The base engine then does what it is good at and nothing that
would be wrong here: config parsing and checks, device placement, timers, monitor, checkpoint
engine, LR schedulers (``_scheduler_from_config``) and ``gradient_clipping``. What its single DP
group cannot express lives in this subclass, each in its own module:

* one global step (``train_step.py``): the 1F1B schedule per heterogeneous pipeline
  (``schedule.py``), the step's one world all-reduce (``step_reduce.py``), the world-wide skip
  decision, clipping and the update; ``train_batch`` reads as its sequence,
* Megatron TP per stage, any group size dividing heads and FFN (``tensor_parallel.py``),
* per-layer / per-finest-shard gradient SUM (``grad_sync.py``; stock averages over one group),
* ZeRO-1/2 across each replica set with torch AdamW (``optimizer.py``),
* the pipeline's sends and receives (``p2p.py``), state by global name, checkpoints and export
  (``state.py``), the plan-aware ``mpu`` (``mpu.py``).

Setup reads as named steps: ``build_settings`` → ``build_plan`` (every rank validates the same
plan and raises the same error before any collective, so bad input never hangs) →
``build_groups`` (collective, same order everywhere) → ``build_stage`` (module, TP, dtype) →
``DeepSpeedEngine.__init__`` → ``build_engine_state`` (what outlives a plan) with the first
:class:`~malleus_ds.engine.runtime.PlanRuntime` (schedule, peers, buckets, optimizer). A plan
switch (``switch.py``) builds the next runtime, moves state into it and drops the old one.

Mixed precision (``"bf16"`` / ``"fp16"``, see ``precision.py``): the stage module is cast here,
before the base engine sees it, and the base engine gets a config without ``fp16`` / ``bf16`` /
``data_types``: its own answer to them would be a ``BF16_Optimizer`` / ``FP16_Optimizer`` over its
single DP group (which we replace), and on CPU it refuses fp16 outright. ``fp16_enabled()`` /
``bfloat16_enabled()`` report the user's setting once the engine is built.

Public surface: ``train_batch(data_iter=None, step=None)`` (one global step, returns the
global-batch mean loss on every rank), ``local_shards()``, ``local_state()`` /
``load_local_state()`` (state by global parameter name, gathered: for tests and tools),
``switch_plan(plan)`` (live migration, ``switch.py``), ``save_checkpoint`` / ``load_checkpoint``
(per-rank slices; load under any plan, ZeRO stage, precision or world size: ``checkpoint.py``;
a Hugging Face folder is ``malleus_ds.export_engine(engine, out_dir)``),
``set_compute_clock``, ``set_stop_source`` and ``last_sums`` (the step's all-reduced numbers,
for a runner's report), ``attach_loop`` (step hooks, ``steploop.py``: the app attaches the
adaptive loop, ``malleus_ds/app/loop.py``; ``malleus_ds.initialize`` does), ``measured_rates`` and
``take_events()`` (``replan`` / ``migrate`` events). bf16 and fp16 (with
static or dynamic loss scaling) train with fp32 masters, fp32 gradient accumulation and reduction
(``precision.py``). Not supported: ZeRO-3, DeepSpeed's ``forward/backward/step`` loop (use
``train_batch``), vocab-parallel embedding/head (they are replicated inside a TP group).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as tdist
from torch import nn

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import log_dist
from malleus_ds_kernels.pack import warm_up as warm_up_pack

from ..samples import pipeline_micro_batches
from ..interop.compat import init_deepspeed_comm
from ..models.base import param_table, tied_params
from ..job_layout import JobLayout, JobLayoutError
from ..plan import Plan, PlanError
from ..resilience.watchdog import phase
from .groups import GROUPS, plan_rank_sets
from ..steploop import NoLoop, StepLoop
from .mpu import PlanMPU
from .p2p import PipelineP2P
from .plan_check import check_job_plan
from .runtime import PlanRuntime, RunningPlan, StageSpec, build_runtime, build_stage, locate
from .precision import Precision
from .state import EngineState
from .step_reduce import StepReduction
from .clip_norm import first_stage_layers, norm_skip
from .comm_log import tensor_mb
from ..interop.ds_config import DsConfig, decode
from ..interop.sections import activation_checkpointing_source
from .settings import MalleusSettings, as_plan, base_ds_config
from ..schedule import Backward, Forward, RecvAct, RecvGrad, SendAct, SendGrad
from .model_input import model_builder
from .train_step import TrainStep


class MalleusEngine(RunningPlan, TrainStep, PipelineP2P, EngineState, DeepSpeedEngine):
    """One engine per rank, built from a plan (DESIGN.md §5).

    ``model``: a model config with the interface of ``malleus_ds/models/base.py`` (our
    ``ModelConfig`` or a Hugging Face ``HFModel``; each rank builds only its layers, seeded by
    ``malleus.seed`` or loaded from the model's folder),
    a whole ``StageModule`` (each rank copies its layers out of it), or a callable
    ``(start, end) -> StageModule``. ``plan``: a ``Plan``, a path, or None to use
    ``config["malleus"]["plan"]``. ``data``: an object with ``batch(ids) -> (inputs, targets)``
    and ``seq_len``, or a factory ``(seq_len, seed=) -> such an object`` (called with the model's
    ``max_seq_len`` and ``malleus.seed``), or None: then every ``train_batch`` needs a
    ``data_iter``. ``malleus_ds.initialize`` (``malleus_ds/app/api.py``) passes the shipped byte
    corpus as the default; the engine itself knows no dataset.
    """

    def __init__(self, model, config=None, plan=None, *, data=None, args=None,
                 settings: MalleusSettings | None = None) -> None:
        init_deepspeed_comm()
        rank, world = tdist.get_rank(), tdist.get_world_size()
        ds = decode(config)               # once: the app may hand it over decoded
        user_cfg = ds.config
        settings = self.build_settings(ds, settings)
        cfg, make_stage = model_builder(model, settings.seed, settings.recompute)
        plan = self.build_plan(as_plan(plan) or settings.plan, cfg, world, settings, user_cfg)
        for sw in settings.switch:      # every scripted switch is checked before any collective
            try:
                self.build_plan(sw.plan, cfg, world, settings, user_cfg)
            except PlanError as e:
                raise PlanError(f"{sw.where} (plan {sw.plan.id}): {e}") from None
        zero_stage, optim = ds.zero_stage, ds.make_optimizer
        self.build_groups(plan, world)
        GROUPS.hold(self, plan_rank_sets(plan, world))     # until a switch or drop (groups.py)
        spec = locate(plan, rank)
        stage_module = build_stage(plan, spec, make_stage, settings.precision)
        loc = spec.located
        mpu = PlanMPU(rank, GROUPS.get((rank,)), spec.tp_group, spec.tp_rank, spec.tp_size,
                       loc[1] if loc else 0, len(plan.pipelines[loc[0]].stages) if loc else 1)
        base_cfg = base_ds_config(user_cfg, plan, loc)
        super().__init__(args=args, model=stage_module, mpu=mpu, config=base_cfg,
                         config_class=DeepSpeedConfig(base_cfg, mpu))
        self._user_cfg, self._make_stage, self._make_optimizer = user_cfg, make_stage, optim
        self.build_engine_state(plan, cfg, settings, zero_stage, data)
        self.migrations: list = []          # MigrationReport of every switch, in order
        self._pending_switches = list(settings.switch)
        self._boundary_at: int | None = None   # the step whose boundary was applied last
        self.control: StepLoop = NoLoop(self.world_size)    # the step hooks: attach_loop
        self.reduction = StepReduction(self.world_size, self.global_rank)   # step_reduce.py
        self._stop_source: Callable[[], int] = lambda: 0     # set_stop_source
        self._last_sums = None              # the last step's StepSums (last_sums)
        self.events: list[dict] = []        # replan / migrate events not yet taken (take_events)

    # ------------------------------------------------------------------ build steps

    @staticmethod
    def build_settings(config: dict | DsConfig,
                       given: MalleusSettings | None = None) -> MalleusSettings:
        """The ``malleus`` section plus the precision from ``fp16`` / ``bf16`` / ``data_types``
        and activation checkpointing from ``activation_checkpointing`` /
        ``pipeline.activation_checkpoint_interval``; pure, so a bad config raises the same
        error on every rank before any collective. ``config``: the ds_config, decoded
        (``interop/ds_config.py``: what MalleusEngine cannot honour is refused there) or a dict
        decoded here. ``given``: settings the caller parsed itself (the app, from its typed run
        config): used instead of the ``malleus`` section (which must then be absent), only the
        precision is read from the ds_config."""
        user_cfg = decode(config).config
        if given is not None:
            if user_cfg.get("malleus"):
                raise ValueError("MalleusEngine: settings were given, and the ds_config has a "
                                 "malleus section too; pass one of the two")
            return replace(given, precision=Precision.from_config(user_cfg))
        s = MalleusSettings.from_config(user_cfg.get("malleus"))
        return replace(s, precision=Precision.from_config(user_cfg),
                       recompute=activation_checkpointing_source(user_cfg) is not None)

    @staticmethod
    def build_plan(plan: Plan | None, cfg, world: int, s: MalleusSettings,
                   user_cfg: dict) -> Plan:
        """Validate on every rank, before any collective: the same error everywhere, no hang."""
        if plan is None:
            raise PlanError("MalleusEngine: no plan given (pass plan=... or set "
                            "ds_config.malleus.plan to a plan JSON file)")
        check_job_plan(plan, cfg, MalleusEngine.job_layout(world, plan, s))
        mbs_cfg = user_cfg.get("train_micro_batch_size_per_gpu")
        if mbs_cfg is not None and mbs_cfg != plan.micro_batch_size:
            raise PlanError(f"ds_config.train_micro_batch_size_per_gpu={mbs_cfg} differs from "
                            f"plan.micro_batch_size={plan.micro_batch_size}; drop it (the plan's wins)")
        return plan

    @staticmethod
    def job_layout(world: int, plan: Plan, s: MalleusSettings) -> JobLayout:
        """The job's shape under ``plan`` (``job_layout.py``): ``malleus.gpus_per_node`` (default:
        the whole world is one node) and ``malleus.tp`` (default: the lcm of the plan's TP
        sizes). Pure: a bad value raises the same error on every rank."""
        try:
            return JobLayout.for_plans(world, plan, gpus_per_node=s.gpus_per_node, tp=s.tp)
        except JobLayoutError as e:
            raise PlanError(f"ds_config.malleus.{e.detail}") from None

    @staticmethod
    def build_groups(plan: Plan, world: int) -> None:
        """Collective: every rank creates the same sorted list of missing groups."""
        GROUPS.ensure(plan_rank_sets(plan, world))

    def build_engine_state(self, plan, cfg, settings, zero_stage, data) -> None:
        """What outlives a plan (data, loss scaler, LR schedule, emulation, dispatch table), and
        the first plan's runtime."""
        self.model_cfg, self.settings = cfg, settings
        self.job = self.job_layout(self.world_size, plan, settings)     # job_layout.py
        self.param_table = param_table(cfg)
        if isinstance(data, type) or (callable(data) and not hasattr(data, "batch")):
            data = data(cfg.max_seq_len, seed=settings.seed)     # a factory, e.g. ByteCorpus
        self.data = data
        self.seq_len = getattr(self.data, "seq_len", cfg.max_seq_len)
        self.precision = settings.precision
        self.act_dtype = self.precision.dtype
        self.loss_scaler = self.precision.make_loss_scaler()
        # what the clipping norm leaves out: stock DeepSpeed's fp32 ZeRO-0 pipeline counts its
        # first stage's gradients only (clip_norm.py); fixed for the engine's life
        self.norm_skip = norm_skip(plan, self.param_table, zero_stage, self.precision.mixed)
        if self.norm_skip and self.gradient_clipping() and self.global_rank == 0:
            log_dist(f"gradient_clipping: the norm counts the first stage's parameters only "
                     f"(layers {first_stage_layers(plan)}), as stock DeepSpeed's fp32 ZeRO-0 "
                     f"pipeline does", ranks=[0])
        self.skipped_steps = 0
        self.runtime = None
        self.adopt(self.build_plan_runtime(plan, self.module, locate(plan, self.global_rank),
                                           zero_stage))
        self.lr_scheduler = self._scheduler_from_config(self.optimizer.optimizer)
        self.straggler = None
        if settings.straggler:
            from ..emulation.straggler import Straggler, StragglerSchedule
            self.straggler = Straggler(StragglerSchedule.parse(settings.straggler,
                                                               self.world_size), self.global_rank)
        self.clock = None
        self.set_compute_clock(None)        # the engine's own until a runner attaches one
        self._dispatch: dict[type, Callable] = {
            Forward: self._exec_forward, Backward: self._exec_backward,
            RecvAct: self._exec_recv, SendAct: self._exec_send,
            RecvGrad: self._exec_recv, SendGrad: self._exec_send,
        }
        warm_up_pack(self.device, {self.precision.dtype, torch.float32})  # no compile in a switch
        # a collective on the default group before the first batch_isend_irecv (NCCL requires it)
        tdist.barrier()

    def build_plan_runtime(self, plan: Plan, module: nn.Module, spec: StageSpec,
                           zero_stage: int, prev: PlanRuntime | None = None) -> PlanRuntime:
        return build_runtime(plan, self.global_rank, spec, module, self.param_table, zero_stage,
                             self._make_optimizer, self.precision, self.device, prev=prev,
                             tied=tied_params(self.model_cfg))

    def adopt(self, rt: PlanRuntime) -> None:
        """Make ``rt`` the running plan. The engine's per-plan attributes read it
        (:class:`~malleus_ds.engine.runtime.RunningPlan`); DeepSpeed's own ``module`` and ``optimizer`` are set here."""
        self.runtime = rt
        self.module = rt.module
        self.optimizer = rt.optimizer
        self.basic_optimizer = rt.optimizer.optimizer
        self.optimizer.loss_scaler = self.loss_scaler     # like DeepSpeed's fp16 optimizers
        self.optimizer.overflow = False

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale now (1.0 without fp16)."""
        return float(self.loss_scaler.cur_scale) if self.loss_scaler is not None else 1.0

    def fp16_enabled(self) -> bool:
        prec = self.__dict__.get("precision")
        return prec.dtype == torch.float16 if prec is not None else super().fp16_enabled()

    def bfloat16_enabled(self) -> bool:
        prec = self.__dict__.get("precision")
        return prec.dtype == torch.bfloat16 if prec is not None else super().bfloat16_enabled()

    def get_data_types(self):
        """(model dtype, gradient accumulation dtype): accumulation is always fp32 here."""
        prec = self.__dict__.get("precision")
        return (prec.dtype, torch.float32) if prec is not None else super().get_data_types()

    # ------------------------------------------------------------------ training

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id is not None and self.stage_id == self.num_stages - 1

    def my_micro_batches(self, step: int) -> list[list[int]]:
        """Sample ids of this pipeline's micro-batches at ``step`` (DESIGN.md §5)."""
        return pipeline_micro_batches(step, self.plan, self.pipeline_id)

    def train_batch(self, data_iter=None, step: int | None = None) -> float:
        """Run one global step of the plan; returns the global-batch mean loss on every rank.

        Data: by default from ``self.data`` by sample id (``step`` picks the global batch,
        default ``global_steps``; pipeline ``i`` takes the next ``m_i`` micro-batches, DESIGN.md
        §5), so every rank can fetch any micro-batch. Or, like stock ``PipelineEngine``, pass
        ``data_iter`` yielding ``(inputs, targets)`` for *this rank's pipeline's* micro-batches
        in order; first and last stages read it once per micro-batch.
        """
        self._check_trainable(data_iter)
        self.apply_scheduled_switch()
        t_step = time.perf_counter()
        step = self._begin_step(data_iter, step)
        # a rank without a stage in the plan runs no schedule; it joins the world collectives
        flats = self._run_schedule(step) if self.located is not None else []
        sums = self._reduce_step(flats)
        self.control.observe(step, sums)
        self.control.after_reduce(step)     # every prober at the same moment
        self._keep_sums(step, sums)
        self._apply_update(flats, sums.overflow)
        self._finish_step(sums.loss, skipped=sums.overflow)
        self.control.step_done(time.perf_counter() - t_step)
        return sums.loss

    def apply_scheduled_switch(self):
        """At the boundary before step ``global_steps`` (collective; ``train_batch`` calls it
        first, a runner may call it earlier to time it apart from the step): the adaptive loop's
        ready decisions and forced re-plans (``control.py``), then the ``malleus.switch`` entry
        due now. Their ``replan`` / ``migrate`` events go to :meth:`take_events`. Returns the
        last MigrationReport or None. Once per step: a second call before the same step (the
        runner's, then ``train_batch``'s) does nothing."""
        if self._boundary_at == self.global_steps:
            return None
        self._boundary_at = self.global_steps
        report = None
        for d in self.control.before_step(self.global_steps):
            if d.plan is not None and d.from_plan != self.plan.id:
                d = d.stale(self.plan.id)
            self.events.append(d.line())
            if d.plan is not None:
                # a step back to an earlier plan (a missed promise) carries the rates that
                # plan was made for
                report = self.switch_plan(d.plan, rates=d.made_for)
            else:
                self.control.considered(d.measured)
        while self._pending_switches and self._pending_switches[0].step < self.global_steps:
            self._pending_switches.pop(0)           # resumed past it
        if self._pending_switches and self._pending_switches[0].step == self.global_steps:
            sw = self._pending_switches.pop(0)
            report = self.switch_plan(sw.plan)
        return report

    def take_events(self) -> list[dict]:
        """``replan`` and ``migrate`` events since the last call, in order (metrics.jsonl)."""
        out, self.events = self.events + self.control.take_events(), []
        return out

    @property
    def measured_rates(self) -> list[float | None]:
        """Each rank's smoothed measured straggling rate (None: not measured yet, or no loop)."""
        return self.control.measured_rates()

    def attach_loop(self, loop) -> None:
        """Drive ``loop`` through the step hooks (``steploop.StepLoop``) from now on (the app
        attaches the adaptive loop: ``malleus_ds/app/loop.py``); every rank attaches one alike."""
        self.control.close()
        self.control = loop
        self._log_comm()

    def _log_comm(self) -> None:
        """Time this rank's communication into the clock's comm log (``comm_log.py``) when
        the attached loop measures links (``measures_links``): on CPU the host's wait, on CUDA
        a pair of events around it (``ComputeClock.comm``)."""
        from .comm_log import CommLog

        clock, loop = getattr(self, "clock", None), getattr(self, "control", None)
        if clock is None:
            return
        want = loop is not None and bool(loop.measures_links)
        if want and clock.comm_log is None:
            clock.comm_log = CommLog(lambda r: self.job.node_of(r))
        elif not want:
            clock.comm_log = None
        red = getattr(self, "reduction", None)     # (built after the first clock: no log)
        if red is not None and red.comm != want:   # the step's all-reduce carries the slots
            self.reduction = StepReduction(self.world_size, self.global_rank, comm=want)

    def switch_plan(self, new_plan, rates=None):
        """Move this running engine to ``new_plan`` (a Plan, path or plan JSON) in place:
        collective, at a step boundary; parameters, fp32 masters and Adam states migrate with
        point-to-point transfers, the LR schedule and loss scaler carry over, and training
        continues with the same math. Returns a :class:`~malleus_ds.engine.switch.MigrationReport`
        (the same on every rank). See ``engine/switch.py``. ``rates``: the measured rates the
        new plan was made for (the adaptive loop's new reference; default: today's measurement)."""
        from .switch import switch_plan
        with phase("migration"):
            report = switch_plan(self, new_plan)
        self.migrations.append(report)
        self.events.append(report.event())
        self.job = self.job.with_plans(self.plan)    # a switch may bring new TP sizes
        self.control.switched(self.plan, rates, self.job, report)
        return report

    def set_compute_clock(self, clock) -> None:
        """Time forward/backward with ``clock`` (a ``malleus_ds.engine.clock.ComputeClock``, e.g. a
        runner's, which also applies its straggler emulation; the runner then calls
        ``clock.start_step``). ``None``: the engine's own clock, with the emulation of
        ``ds_config.malleus.straggler``, started by ``train_batch``. TP all-reduces inside
        forward/backward are left out of compute via ``clock.excluded()``, so a healthy rank
        waiting for a slow TP peer does not look slow itself."""
        from .clock import ComputeClock
        from . import tensor_parallel

        self._own_clock = clock is None
        if clock is None:
            clock = ComputeClock(self.straggler, str(self.device).startswith("cuda"))
        self.clock = clock
        tensor_parallel.set_comm_context(self._tp_comm)
        self._log_comm()

    def _tp_comm(self, t, group):
        """The context a TP all-reduce's wait runs in (``tensor_parallel.set_comm_context``):
        left out of compute, and timed over its group where links are measured or emulated."""
        clock = self.clock
        if clock.links is None and clock.comm_log is None:
            return clock.excluded()
        return clock.collective(tdist.get_process_group_ranks(group), tensor_mb(t))

    @property
    def compute_seconds(self) -> float:
        """This rank's compute seconds in the current (or last) step, emulated slowdown included."""
        return self.clock.compute_s

    # ------------------------------------------------------------------ stock API

    def forward(self, *inputs, **kwargs):
        """Run this rank's stage module (no pipeline); training goes through ``train_batch``."""
        return self.module(*inputs, **kwargs)

    def backward(self, *args, **kwargs):
        raise RuntimeError("MalleusEngine runs whole pipelined steps: use engine.train_batch()")

    def step(self, *args, **kwargs):
        raise RuntimeError("MalleusEngine runs whole pipelined steps: use engine.train_batch()")
