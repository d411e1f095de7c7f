"""The parts of one global step of MalleusEngine, in the order ``train_batch`` runs them.

``train_batch`` (engine.py) reads as the sequence; each part is here (a mixin, like
``p2p.py``: it reads the engine's running plan, ``runtime.py``, its clock, its step loop and its
precision):

1. :meth:`TrainStep._begin_step`: the step's number, data source, loss sum and loss scale;
2. :meth:`TrainStep._run_schedule`: the pipeline's 1F1B schedule (``schedule.py``), its
   instructions dispatched to the forward / backward below and the sends / receives of
   ``p2p.py``, cut into NCCL-safe calls (``wire.py``); then the tied pair and the replica sum
   of the gradients (``tied.py``, ``grad_sync.py``), in fp32;
3. :meth:`TrainStep._reduce_step`: the step's one world all-reduce (``step_reduce.py``): the
   global-batch loss, the non-finite count of the summed gradients, the step loop's slots and
   each rank's clock numbers and stop signal, kept for a runner's report
   (:attr:`TrainStep.last_sums`);
4. :meth:`TrainStep._apply_update`: the loss scaler sees the overflow flag; a step with
   non-finite gradients is skipped on every rank alike, otherwise unscale, clip (one more world
   all-reduce), the optimizer's step and the LR schedule's;
5. :meth:`TrainStep._finish_step`: counters, monitor and log.

The order of the collectives is the order every rank issues them; NCCL matches them by that
order alone (docs/DESIGN.md §8b), so no part may add, drop or move one.
"""
from __future__ import annotations

from dataclasses import replace

import torch.distributed as tdist

from deepspeed.utils import log_dist

from ..resilience.watchdog import phase
from ..samples import loss_share
from ..schedule import Backward, Forward
from .wire import wire_calls


class TrainStep:
    """One global step's parts (module doc); ``MalleusEngine.train_batch`` calls them."""

    def _check_trainable(self, data_iter) -> None:
        """Refuse a step on an engine a failed migration broke, or without any data."""
        if getattr(self, "_broken", None):
            from ..migrate.transport import MigrationError
            raise MigrationError(self._broken)
        if data_iter is None and self.data is None:
            raise ValueError("MalleusEngine.train_batch: the engine was built without data= and "
                             "no data_iter was passed; give one (malleus_ds.initialize defaults "
                             "data to the shipped byte corpus)")

    def _begin_step(self, data_iter, step: int | None) -> int:
        """The step's number (default ``global_steps``), data source, loss sum and loss scale;
        starts the engine's own clock."""
        step = self.global_steps if step is None else step
        self._data_iter = data_iter
        self._loss_sum = 0.0
        self._step = step
        if self._own_clock:
            self.clock.start_step(step)
        self._loss_mult = self.cur_scale       # fp16: this step's loss scale (1.0 otherwise)
        return step

    # ------------------------------------------------------------------ the schedule

    def _run_schedule(self, step: int) -> list:
        """This rank's part of the pipeline schedule at ``step``, then its gradients summed
        over their replicas: the fp32 buckets as ``(flat, ...)`` pairs."""
        for p in self.named.values():
            p.grad = None
        self.grad_sync.zero_()
        self._step, self._ids = step, self.my_micro_batches(step)
        self._inputs, self._outputs, self._grads_in, self._grads_out = {}, {}, {}, {}
        self._sends: list = []
        for call in wire_calls(self.schedule):     # NCCL-safe cut (engine/wire.py)
            if len(call) == 2:
                self._exec_send_recv(*call)
            else:
                self._dispatch[type(call[0])](call[0])
        for h, _ in self._sends:
            h.wait()
        self._sends = []
        with phase("all-reduce"):
            self._sync_tied()               # tied embedding/head: one gradient (tied.py)
            return self.grad_sync.reduce(self.clock)   # fp32, summed over replicas

    def _timed(self, fn):
        with self.clock.compute():
            return fn()

    def _exec_forward(self, ins: Forward) -> None:
        k = ins.micro_batch
        x = y = None
        if self.is_first_stage or self.is_last_stage:
            batch = next(self._data_iter) if self._data_iter is not None \
                else self.data.batch(self._ids[k])
            x, y = (t.to(self.device) for t in batch)       # (B, T) tokens, (B, T) targets
        if not self.is_first_stage:
            x = self._inputs[k]                             # (B, T, H), requires grad
        scale = loss_share(self.plan.micro_batch_size, self.plan.global_batch_size)

        def run():
            out = self.module(x)
            return self.model_cfg.loss(out, y) * scale if self.is_last_stage else out

        out = self._timed(run)
        if self.is_last_stage:
            # summed in fp64 on the device, as one process adds the fp32 ``.item()`` values
            self._loss_sum = self._loss_sum + out.detach().double()
            if self._loss_mult != 1.0:      # fp16 loss scaling (fp32 loss, power-of-2 scale)
                out = out * self._loss_mult
        self._outputs[k] = out

    def _exec_backward(self, ins: Backward) -> None:
        k = ins.micro_batch
        out = self._outputs.pop(k)
        grad = None if self.is_last_stage else self._grads_out.pop(k)
        def run():
            out.backward(grad)
            self._accumulate_grads()

        self._timed(run)
        if not self.is_first_stage:
            self._grads_in[k] = self._inputs.pop(k).grad

    def _accumulate_grads(self) -> None:
        """After a micro-batch's backward: gradients into the fp32 buckets (BF16_Optimizer's
        update_hp_grads; already done per parameter with immediate_grad_update)."""
        if not self.precision.immediate_grad_update:
            self.runtime.accumulate()

    def _sync_tied(self) -> None:
        """Both copies of a tied pair get the pipeline's summed gradient, read out of and written
        back into the buckets (only the ranks ``TiedSync`` involves pay for it)."""
        tied = self.runtime.tied
        names = tied.names()
        if names:
            grads = {n: self.grad_sync.read(n) for n in names}
            tied(grads)
            for n in names:
                self.grad_sync.write(n, grads[n])

    # ------------------------------------------------------------------ after the schedule

    def _reduce_step(self, flats):
        """The step's one world all-reduce (``step_reduce.py``), read back once: the global-batch
        loss, the non-finite count of the summed gradients (fp16/bf16: every rank takes the same
        skip decision), the step loop's per-rank timings and rank 0's "decision ready" flag,
        and each rank's clock numbers and stop signal (a runner's report: :attr:`last_sums`).
        Returns the :class:`~malleus_ds.steploop.StepSums`."""
        clock = self.clock
        compute_s = clock.compute_s             # first: on CUDA it reads the step's events
        ready, probe = self.control.contribute(compute_s)
        log = clock.comm_log
        red = self.reduction.vector(ready=ready, compute_s=compute_s, probe_per_unit=probe,
                                    device=self.device,
                                    comm=log.values() if log is not None else None,
                                    emulated_s=clock.emulated_s, wait_s=clock.wait_s,
                                    link_s=clock.link_emulated_s, stop=self._stop_source())
        if self.is_last_stage and self.tp_rank == 0:
            self.reduction.set_loss(red, self._loss_sum)   # on the device until now
        if self.precision.check_overflow:        # counted on the device: no host sync per bucket
            self.reduction.add_nonfinite(red, flats)
        with phase("all-reduce"):
            tdist.all_reduce(red)
            return self.reduction.read(red)      # the step's one read of it (waits on GPU)

    def _keep_sums(self, step: int, sums) -> None:
        """Keep the step's sums for :attr:`last_sums`, marked ``late`` when the loop may have
        timed more of the step after the all-reduce (its probes; the same on every rank)."""
        if self.control.timed_after_reduce(step):
            sums = replace(sums, late=True)
        self._last_sums = sums

    @property
    def last_sums(self):
        """The last step's all-reduced :class:`~malleus_ds.steploop.StepSums` (None before the
        first): every rank's clock numbers as of the all-reduce (whole unless ``late``) and the
        stop signal every rank agrees on. A runner reports the step from them
        (``StepReporter.step_done(sums=)``) with no collective of its own."""
        return self._last_sums

    def set_stop_source(self, read) -> None:
        """``read()`` -> this rank's stop signal (0: none), read just before each step's
        all-reduce; the largest any rank raised is every rank's ``last_sums.stop``, so all stop
        after the same step. A signal raised after a step's all-reduce shows in the next one's."""
        self._stop_source = read

    def _apply_update(self, flats, overflow: bool) -> None:
        """The loss scaler sees ``overflow`` (DeepSpeed's static/dynamic scaler); a step with it
        changes nothing more. Otherwise: unscale, clip, the optimizer's step, the LR schedule's."""
        self.optimizer.overflow = overflow
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
        if overflow:
            return
        if self._loss_mult != 1.0:                    # unscale in fp32 (a power of 2: exact)
            for f, _ in flats:
                f.mul_(1.0 / self._loss_mult)
        coef = 1.0
        clip = self.gradient_clipping()
        if clip and clip > 0:
            # on the device: one all-reduce and one host read per step (the norm, for the
            # coefficient and the logs)
            # (without the tied head copies, and, for stock DeepSpeed's fp32 ZeRO-0 pipeline,
            # without what its first stage does not hold: clip_norm.py)
            skip = self.runtime.tied.skip_in_norm | self.norm_skip
            sq = self.optimizer.owned_sq_norm(flats, skip).reshape(1)
            with phase("all-reduce"):
                tdist.all_reduce(sq)
                self._global_grad_norm = float(sq.sqrt())
            coef = min(1.0, clip / (self._global_grad_norm + 1e-6))
        self.optimizer.step(flats, coef)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _finish_step(self, loss: float, skipped: bool) -> None:
        """Counters, monitor and log (a skipped step still counts in global_steps, not in the
        LR schedule: DeepSpeedEngine._take_model_step)."""
        if skipped:
            self.skipped_steps += 1
            if self.global_rank == 0:
                log_dist(f"step={self.global_steps}: non-finite gradients, step skipped "
                         f"({self.precision.name}; loss scale now {self.cur_scale:g})", ranks=[0])
        self.global_steps += 1
        self.global_samples += self.plan.global_batch_size
        if self.global_rank == 0:
            if self.monitor.enabled:
                self.monitor.write_events([("Train/Samples/train_loss", loss, self.global_samples)])
            every = self.steps_per_print()
            if every and self.global_steps % every == 0:
                log_dist(f"step={self.global_steps} loss={loss:.6f} "
                         f"lr={self.optimizer.param_groups[0]['lr']:.3e}", ranks=[0])
