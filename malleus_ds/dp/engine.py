"""``MalleusDPEngine``: DeepSpeed's own engine (ZeRO-1/2/3, ``forward`` / ``backward`` /
``step``, ``save_checkpoint`` / ``load_checkpoint``) with each step's batch split unevenly.

DeepSpeed averages the ranks' gradients (it divides by the world size with no per-rank weight,
and refuses ``gradient_allreduce_op: "sum"`` under ZeRO-3), and divides every micro-batch's loss
by ``gradient_accumulation_steps``. When rank ``r`` runs ``n_r`` of the ``M`` samples of each
micro-batch slot and its loss is the mean over its ``n_r`` samples, backpropagating
``loss * n_r * world / M`` on each rank makes DeepSpeed's averaged gradient exactly the mean
gradient over the step's global batch, and gradient clipping sees that true global gradient
(:meth:`~malleus_ds.dp.split.Split.weight`, which also covers a summed loss, and a loss already
normalised over the whole step that needs no weight). The engine adds only that weight, in
:meth:`MalleusDPEngine.backward`, and the split it comes from, set at a step boundary
(:meth:`MalleusDPEngine.set_split`, the same split on every rank). A new split moves no state:
every rank keeps its ZeRO shards and runs every micro-batch, only their sizes change.

The loss must go through ``engine.backward(loss)``: a direct ``loss.backward()`` is not weighted,
and is refused while the split is uneven. Both of DeepSpeed's accumulation styles work: a
``step()`` after every micro-batch's ``backward`` (DeepSpeed's own loop), or
``set_gradient_accumulation_boundary`` and one ``step()`` per optimizer step (accelerate's, so the
Hugging Face Trainer's): a step's boundary is where the boundary ``step()`` ran, counted in
backwards, not in DeepSpeed's ``micro_steps``.

Each ``forward`` (in training mode) and ``backward`` is a compute span of the rank's
:class:`~malleus_ds.engine.clock.ComputeClock`, its step started by the step's first one;
DeepSpeed's communication inside them is left out (``dp/timing.py``), and the straggler
emulation of ``ds_config.malleus.straggler`` slows the rank through it. With a policy attached
(:meth:`MalleusDPEngine.attach_loop`; ``malleus_ds.initialize`` attaches one), each optimizer
step's boundary runs the re-split loop (``dp/loop.py``): one small all-reduce issued, the last
step's read, and the split decided from every rank's seconds per sample, on every rank.
``save_checkpoint`` keeps the split and the loop's state in DeepSpeed's model-states file;
``load_checkpoint`` restores them (a checkpoint of another world size: the split kept, one
line).

:func:`initialize` builds the engine the way ``deepspeed.initialize`` builds
``DeepSpeedEngine`` for data parallelism, and returns the same four values; its dataloader is a
:class:`~malleus_ds.dp.sampler.ResplitLoader` over stock's global sample order.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.engine import DeepSpeedEngine

from malleus_ds.dp.loop import ResplitLoop, SplitPolicy
from malleus_ds.dp.sampler import ResplitLoader
from malleus_ds.dp.settings import DPSettings, split_config
from malleus_ds.dp.split import LOSS_KINDS, Split
from malleus_ds.dp.timing import exclude_communication


class MalleusDPEngine(DeepSpeedEngine):
    """A ``DeepSpeedEngine`` whose ranks each weight their loss by their share of the step.

    Constructed as ``DeepSpeedEngine`` is (use :func:`initialize`), plus ``split`` (None:
    stock's equal split) and ``loss``: how the loss given to :meth:`backward` is normalised
    (``"mean"`` over the rank's micro-batch samples, the default; ``"sum"`` over them;
    ``"global"``: already normalised over the step, weighted by nothing; see
    :meth:`Split.weight <malleus_ds.dp.split.Split.weight>`); ``settings``: the ds_config's
    ``malleus`` section as this engine reads it (:class:`~malleus_ds.dp.settings.DPSettings`;
    its straggler emulation).
    """

    def __init__(self, *args, split: Split | None = None, loss: str = "mean",
                 settings: DPSettings | None = None, **kwargs):
        if loss not in LOSS_KINDS:
            raise ValueError(f"loss={loss!r}: must be one of {', '.join(LOSS_KINDS)} (how the "
                             f"loss given to backward is normalised)")
        super().__init__(*args, **kwargs)
        self.loss_kind = loss
        self._backward_at = -1      # micro_steps when backward last ran (its step() pending)
        self._backwards = 0         # backward calls of the current step (0: at its boundary)
        self._split = Split.equal(self.dp_world_size, self.train_batch_size(),
                                  self.gradient_accumulation_steps())
        if split is not None:
            self.set_split(split)
        self.settings = settings or DPSettings()
        self.clock = self._build_clock(self.settings)
        self._clock_step = -1       # the step the clock was last started for
        self._done_split: Split | None = None   # the split the last finished step ran under
        self.loop: ResplitLoop | None = None
        self._loss_part = 0.0       # this rank's part of the step's loss (global_loss's weights)
        self._step_t0: float | None = None      # when the step's first forward started

    # --- the compute clock and the re-split loop --------------------------------------------

    def _build_clock(self, settings: DPSettings):
        from malleus_ds.emulation.straggler import Straggler, StragglerSchedule
        from malleus_ds.engine.clock import ComputeClock

        straggler = None
        if settings.straggler:
            from deepspeed import comm as dist

            straggler = Straggler(StragglerSchedule.parse(settings.straggler,
                                                          dist.get_world_size()),
                                  dist.get_rank())
        clock = ComputeClock(straggler, cuda=str(self.device).startswith("cuda"))
        self.left_out_of_compute = exclude_communication(self, clock)   # "owner.name"s
        return clock

    def attach_loop(self, policy: SplitPolicy) -> ResplitLoop | None:
        """Run the re-split loop (``dp/loop.py``) with ``policy`` from the next step boundary
        on; the same call on every rank, each with its own policy (deterministic: every rank's
        decides the same). One rank alone has nothing to split: no loop (returns None). The
        process's exit reads the last step's all-reduce (its observers' facts)."""
        self.loop = ResplitLoop(self, policy) if self.dp_world_size > 1 else None
        if self.loop is not None:
            import atexit
            import weakref

            atexit.register(_flush_at_exit, weakref.ref(self.loop))
        return self.loop

    @property
    def split_events(self) -> list[dict]:
        """Every re-split the loop applied (``ResplitLoop.events``), in order."""
        return self.loop.events if self.loop is not None else []

    def _start_clock(self) -> None:
        if self._clock_step != self.global_steps:
            import time

            self._clock_step = self.global_steps
            self._step_t0 = time.perf_counter()
            self.clock.start_step(self.global_steps)

    def forward(self, *inputs, **kwargs):
        """DeepSpeed's ``forward``, timed as compute in training mode."""
        if not self.module.training:
            return super().forward(*inputs, **kwargs)
        self._start_clock()
        with self.clock.compute():
            return super().forward(*inputs, **kwargs)

    def step(self, *args, **kwargs):
        """DeepSpeed's ``step``; at the step's boundary, then the re-split loop's all-reduce
        (with a loop attached)."""
        boundary = self.is_gradient_accumulation_boundary()
        split = self._split
        out = super().step(*args, **kwargs)
        if boundary:
            self._done_split, self._backwards = split, 0
        if boundary and self.loop is not None:
            timed = self._clock_step == self.global_steps - 1
            self.loop.after_step(self.global_steps - 1, split,
                                 self.clock.compute_s if timed else 0.0, self._loss_part,
                                 self.clock.emulated_s if timed else 0.0, self._step_t0)
        if boundary:
            self._loss_part = 0.0
        return out

    # --- checkpoints: the split and the loop's state go with DeepSpeed's --------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint``, with the split in force and the re-split loop's
        state (:meth:`resplit_state`) in the model-states file rank 0 writes, under
        ``client_state["malleus_dp"]``: written with the checkpoint, or not at all."""
        client_state = dict(client_state or {})
        if STATE_KEY in client_state:
            raise ValueError(f"client_state[{STATE_KEY!r}] is MalleusDPEngine's own (the split "
                             f"and the re-split loop's state): use another key")
        client_state[STATE_KEY] = self.resplit_state()
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state,
                                       save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """DeepSpeed's ``load_checkpoint``; then the saved split and loop state are restored
        (:meth:`load_resplit_state`; not with ``load_module_only``), and left out of the
        returned client state."""
        path, client = super().load_checkpoint(
            load_dir, tag, load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        state = client.pop(STATE_KEY, None) if isinstance(client, dict) else None
        if state is not None and not load_module_only:
            self.load_resplit_state(state)
        return path, client

    def resplit_state(self) -> dict:
        """The split in force (the next step's) and, with a loop, its state
        (``ResplitLoop.state_dict``: the decision for the step after, the policy's window):
        plain values."""
        s = self._split
        return {"world": s.world, "global_batch": s.global_batch,
                "micro_batches": s.micro_batches, "shares": list(s.shares),
                "loop": self.loop.state_dict() if self.loop is not None else None}

    def load_resplit_state(self, state: dict) -> bool:
        """Take the split and loop state :meth:`resplit_state` gave, at a step boundary, on
        every rank. Saved for another world or batch: one line (rank 0) and the current split
        kept (the loop starts afresh). Returns whether it was taken."""
        import logging

        want = (self.dp_world_size, self.train_batch_size(), self.gradient_accumulation_steps())
        try:
            got = (state["world"], state["global_batch"], state["micro_batches"])
            shares = state["shares"]
        except (TypeError, KeyError) as e:
            raise ValueError(f"the checkpoint's {STATE_KEY!r} state must hold world, "
                             f"global_batch, micro_batches and shares; got {state!r}") from e
        if tuple(got) != want:
            if self.dp_rank() == 0:
                logging.getLogger(__name__).warning(
                    "the checkpoint's split %s is for %d data-parallel ranks, a batch of %d in "
                    "%d micro-batches; this job has %d ranks, %d in %d: resuming from the "
                    "split %s instead, the ranks' speeds re-measured", list(shares), *got,
                    *want, list(self._split.shares))
            return False
        self.set_split(Split(tuple(shares), want[2]))
        if self.loop is not None and state.get("loop") is not None:
            self.loop.load_state_dict(state["loop"])
        return True

    def destroy(self):
        """DeepSpeed's ``destroy`` (also its ``__del__``'s), the re-split loop's last all-reduce
        read first (given up after a minute, with one line: a peer gone)."""
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.flush(timeout_s=60.0):
            print(f"malleus_ds: step {loop._inflight.step}'s re-split all-reduce did not "
                  f"complete within 60 s (a peer gone?): its facts are not read")
        super().destroy()

    # --- the split --------------------------------------------------------------------------

    @property
    def split(self) -> Split:
        """The split of the current step (the same on every rank)."""
        return self._split

    def dp_rank(self) -> int:
        from deepspeed import comm as dist

        return dist.get_rank(group=self.data_parallel_group)

    def at_step_boundary(self) -> bool:
        """No micro-batch of the current step has run its ``backward`` yet (the last step's
        boundary ``step()`` has run)."""
        return self._backwards == 0

    def set_split(self, split: Split) -> None:
        """Use ``split`` from the next micro-batch on. Call it at a step boundary, with the same
        split on every rank; it must keep DeepSpeed's batch (world, ``train_batch_size``,
        ``gradient_accumulation_steps``)."""
        want = (self.dp_world_size, self.train_batch_size(), self.gradient_accumulation_steps())
        got = (split.world, split.global_batch, split.micro_batches)
        if got != want:
            raise ValueError(f"split {split.json()} covers {got[0]} ranks, a batch of {got[1]} "
                             f"in {got[2]} micro-batches; this engine has {want[0]} "
                             f"data-parallel ranks, train_batch_size={want[1]} and "
                             f"gradient_accumulation_steps={want[2]}")
        loader = self.training_dataloader
        gas, done = self.gradient_accumulation_steps(), self.micro_steps
        why = ("a backward ran and its step() has not" if self._backward_at == done else
               f"{self._backwards} of the step's {gas} micro-batches have run"
               if self._backwards else
               "its dataloader has started the step"
               if isinstance(loader, ResplitLoader) and loader.mid_step() else None)
        if why:
            raise ValueError(f"set_split at a step boundary: {why} (micro-step {done}, "
                             f"gradient_accumulation_steps={gas})")
        self._split = split
        if isinstance(loader, ResplitLoader):
            loader.set_split(split)

    def loss_weight(self) -> float:
        """What :meth:`backward` multiplies this rank's loss by under the current split."""
        return self._split.weight(self.dp_rank(), self.loss_kind)

    def _loss_factor(self, split: Split | None = None) -> float:
        """What one unweighted micro-batch loss of this rank adds to the step's loss over the
        global batch under ``split`` (default: the current one)."""
        s, gas = split or self._split, self.gradient_accumulation_steps()
        if self.loss_kind == "mean":
            return s.shares[self.dp_rank()] / s.global_batch
        if self.loss_kind == "sum":
            return 1.0 / s.global_batch
        return 1.0 / (s.world * gas)

    # --- the only change to DeepSpeed's training loop ---------------------------------------

    def backward(self, loss, *args, **kwargs):
        """DeepSpeed's ``backward`` of ``loss * loss_weight()``; returns what DeepSpeed's
        returns (the weighted loss, divided by the accumulation steps unless
        ``scale_wrt_gas=False``). With ``scale_wrt_gas=False`` (accelerate's call) the caller has
        divided the loss by the accumulation steps itself (the Trainer does), or normalised it
        over the whole step: the weight is the same, and the step's loss (``metrics.jsonl``)
        counts the loss times the accumulation steps."""
        w = self.loss_weight()
        self._backward_at = self.micro_steps
        self._backwards += 1
        if self.loop is not None:       # its part of the step's loss, kept on the device
            f = self._loss_factor()
            if not _scale_wrt_gas(args, kwargs):
                f *= self.gradient_accumulation_steps()
            self._loss_part = self._loss_part + loss.detach().double() * f
        self._start_clock()
        with self.clock.compute():
            return super().backward(loss if w == 1.0 else loss * w, *args, **kwargs)

    def _backward_prologue(self):
        # DeepSpeed runs this from hooks on the forward's outputs when the user calls
        # ``loss.backward()`` directly (ZeRO only): that loss is not weighted, so its gradient
        # would be silently wrong under an uneven split
        if not self._running_engine_backward and self.loss_weight() != 1.0:
            raise RuntimeError(f"under the split {list(self._split.shares)} each rank's loss "
                               f"must be weighted by its share: call engine.backward(loss), "
                               f"not loss.backward()")
        super()._backward_prologue()

    # --- reporting --------------------------------------------------------------------------

    def global_loss(self, losses: Sequence[Any]) -> float:
        """The step's loss over its global batch, on every rank (one all-reduce): ``losses`` are
        this rank's unweighted losses of the step's ``gradient_accumulation_steps``
        micro-batches, normalised as ``loss`` says. For ``"mean"`` this is the mean over the
        global batch, what stock DeepSpeed's loss averaged over ranks and micro-batches is.
        Called at a step boundary, the losses are the step just finished, under the split it
        ran (whatever split the loop or ``set_split`` put in force since); called before the
        last micro-batch's ``step()``, the current step's."""
        from deepspeed import comm as dist

        vals = [float(x) for x in losses]
        s, gas = self._split, self.gradient_accumulation_steps()
        if self.at_step_boundary() and self._done_split is not None:
            s = self._done_split
        if len(vals) != gas:
            raise ValueError(f"{len(vals)} losses for a step of {gas} micro-batches")
        t = torch.tensor([sum(vals) * self._loss_factor(s)], dtype=torch.float64)
        dist.all_reduce(t, group=self.data_parallel_group)
        return float(t.item())


#: the key of ``client_state`` under which a checkpoint keeps the split and the loop's state
STATE_KEY = "malleus_dp"


def _flush_at_exit(ref) -> None:
    """At the process's exit: read the loop's last all-reduce (its observers write the last
    step's facts), if it completed; one line if it cannot."""
    import sys

    loop = ref()
    if loop is None or loop._inflight is None:
        return
    try:
        if not loop.flush(timeout_s=10.0):
            print(f"malleus_ds: step {loop._inflight.step}'s re-split all-reduce did not "
                  f"complete within 10 s of the exit: its metrics line is not written",
                  file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the exit goes on
        print(f"malleus_ds: reading the last step's re-split all-reduce at exit failed: {e}",
              file=sys.stderr)


def _scale_wrt_gas(args: tuple, kwargs: dict) -> bool:
    """``DeepSpeedEngine.backward(loss, retain_graph=False, scale_wrt_gas=True)``'s third
    argument, from the extra arguments given after ``loss``."""
    if "scale_wrt_gas" in kwargs:
        return bool(kwargs["scale_wrt_gas"])
    return bool(args[1]) if len(args) > 1 else True


def initialize(args: Any = None, model: torch.nn.Module = None,
               optimizer: Any = None, model_parameters: Any = None,
               training_data: Optional[torch.utils.data.Dataset] = None,
               lr_scheduler: Any = None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable] = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None, *,
               split: Split | None = None, loss: str = "mean"):
    """``deepspeed.initialize`` for pure data parallelism (ZeRO-0/1/2/3), building a
    :class:`MalleusDPEngine`: the same arguments, the same four results ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. ``training_dataloader`` (when ``training_data``, a
    map-style dataset, is given) is a :class:`ResplitLoader` over stock's sample order that
    follows the engine's split. ``split``: the first split (None: equal, stock's); ``loss``:
    see :class:`MalleusDPEngine`. The ds_config's ``malleus`` section
    (:class:`~malleus_ds.dp.settings.DPSettings`) is read here and not passed to DeepSpeed; its
    straggler emulation applies. No re-split loop is attached here: ``malleus_ds.initialize``
    attaches one (:meth:`MalleusDPEngine.attach_loop`) unless ``malleus.adaptive`` is false.

    Refused, naming what to use instead: a ``PipelineModule``, an ``mpu``, ``mesh_param`` or
    sequence parallelism, the hybrid engine, AutoTP, curriculum learning."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime import zero
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.tensor_parallel import init_utils

    if loss not in LOSS_KINDS:
        raise ValueError(f"loss={loss!r}: must be one of {', '.join(LOSS_KINDS)} (how the "
                         f"loss given to backward is normalised)")
    if model is None:
        raise ValueError("malleus_ds.dp.initialize requires a model")
    other = "use deepspeed.initialize (or Malleus's pipeline engine) for it"
    if isinstance(model, PipelineModule):
        raise ValueError(f"a PipelineModule is not data parallel: {other}")
    if mpu is not None or mesh_param is not None:
        raise ValueError(f"mpu / mesh_param set model or sequence parallel groups; "
                         f"malleus_ds.dp is pure data parallel: {other}")
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ValueError("a ds_config in both args.deepspeed_config and config=")
        config = args.deepspeed_config
    if config is None:
        raise ValueError("malleus_ds.dp.initialize needs a ds_config (config= or "
                         "args.deepspeed_config)")
    if not isinstance(config, dict):
        config = init_utils.load_ds_config(config)
    config, settings = split_config(config)
    if config.get("sequence_parallel_size", 1) not in (1, None):
        raise ValueError(f"ds_config sequence_parallel_size="
                         f"{config['sequence_parallel_size']}: sequence parallelism is not "
                         f"pure data parallel: {other}")
    if (config.get("tensor_parallel") or {}).get("autotp_size", 0) or \
            init_utils._TP_MODEL_INIT_ARGS is not None:
        raise ValueError(f"tensor parallelism (AutoTP / tp_model_init) is not pure data "
                         f"parallel: {other}")
    if training_data is not None and (
            isinstance(training_data, torch.utils.data.IterableDataset)
            or not (hasattr(training_data, "__getitem__") and hasattr(training_data, "__len__"))):
        raise ValueError("training_data must be a map-style dataset (__getitem__ and __len__): "
                         "each step's samples are dealt by index")

    zero.partition_parameters.shutdown_init_context()
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=distributed_port,
                          dist_init_required=dist_init_required)
    config_class = DeepSpeedConfig(config, None, mesh_device=None)
    if config_class.hybrid_engine.enabled:
        raise ValueError(f"the hybrid engine (RLHF generation) is not supported: {other}")
    deepspeed.set_optimizer_flags(config_class, model)
    engine = MalleusDPEngine(args=args, model=model, optimizer=optimizer,
                             model_parameters=model_parameters, training_data=None,
                             lr_scheduler=lr_scheduler, mpu=None,
                             dist_init_required=dist_init_required, collate_fn=collate_fn,
                             config=config, mesh_device=None, config_class=config_class,
                             split=split, loss=loss, settings=settings)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    if training_data is not None:
        if engine.curriculum_learning_enabled():
            raise ValueError("curriculum learning picks its own samples per step; it cannot be "
                             f"re-split: {other}")
        loader = ResplitLoader(training_data, engine.split, engine.dp_rank(), collate_fn,
                               drop_last=engine.dataloader_drop_last())
        loader.tput_timer = engine.tput_timer
        engine.training_data, engine.training_dataloader = training_data, loader
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
