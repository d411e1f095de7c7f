"""MalleusEngine's training state by global parameter name: ``local_shards``, ``local_state`` /
``load_local_state`` / ``local_params`` (tests, tools, the export), ``save_checkpoint`` /
``load_checkpoint`` (per-rank slices, ``checkpoint.py``). A Hugging Face folder of a running
engine is ``malleus_ds.export_engine(engine, out_dir)`` (``malleus_ds/export/``, above the
engine: the engine imports no app code). A mixin: it reads the engine's ``named`` parameters, ``optimizer``,
``param_table``, ``precision`` and TP coordinates."""
from __future__ import annotations

from pathlib import Path

import torch

from .precision import load_scaler_state, scaler_state


class EngineState:
    def local_state(self) -> dict:
        """This rank's training state by global parameter name, for re-planning / migration:
        ``{"params": {name: shard}, "exp_avg": {...}, "exp_avg_sq": {...}, "step": Adam step,
        "global_steps": steps trained, "skipped_steps": ..., "loss_scaler": fp16 scaler state
        or None}``; shards as in :meth:`local_shards`. With bf16/fp16, ``params`` are the fp32
        MASTER weights (the low-precision parameters are their casts), so a re-plan loses
        nothing. Collective (ZeRO partitions are gathered): call on every rank."""
        st = self.optimizer.gather_state(masters=self.precision.mixed)
        params = st.pop("master", None)
        if params is None:
            params = {n: p.detach().clone() for n, p in self.named.items()}
        return {"params": params, **st, "step": self.optimizer.step_count(),
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "loss_scaler": scaler_state(self.loss_scaler)}

    def local_params(self) -> dict[str, torch.Tensor]:
        """``local_state()["params"]`` alone: fp32 values of this rank's shards by global name
        (the masters under bf16/fp16: collective then, on every rank; local copies in fp32)."""
        if self.precision.mixed:
            return self.optimizer.gather_state(masters=True, moments=False)["master"]
        return {n: p.detach().clone() for n, p in self.named.items()}

    @torch.no_grad()
    def load_local_state(self, state: dict) -> None:
        """Inverse of :meth:`local_state` for *this* engine's local shards (a migrator or a
        checkpoint loader slices them out of the old layout). Local only, no communication."""
        missing = sorted(set(self.named) - set(state["params"]))
        if missing:
            raise KeyError(f"load_local_state: no state for local parameters {missing[:4]}...")
        for n, p in self.named.items():
            if state["params"][n].shape != p.shape:
                raise ValueError(f"load_local_state: {n} has shape {tuple(state['params'][n].shape)}, "
                                 f"this rank holds {tuple(p.shape)}")
            p.copy_(state["params"][n])     # casts fp32 masters to bf16/fp16 when mixed
        # masters from the given (fp32) values, not from the low-precision parameters
        self.optimizer.load_state({k: state[k] for k in ("exp_avg", "exp_avg_sq")}, state["step"],
                                  params=state["params"])
        load_scaler_state(self.loss_scaler, state.get("loss_scaler"))
        self.skipped_steps = state.get("skipped_steps", self.skipped_steps)
        self.global_steps = state.get("global_steps", self.global_steps)
        self.global_samples = self.global_steps * self.plan.global_batch_size

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **_kw):
        """Every rank writes what it holds (parameter shards, fp32 masters, its ZeRO partition of
        Adam's moments; nothing gathered) to ``save_dir/tag/malleus_rank{r:05d}.pt``; rank 0
        commits ``meta.json`` and ``save_dir/latest``. Loads under any plan, ZeRO stage,
        precision or world size. Collective. See ``engine/checkpoint.py``."""
        from .checkpoint_save import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def snapshot_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """The step-boundary half of :meth:`save_checkpoint`: this rank's state copied to host
        memory and the tag folder prepared (collective). ``engine.checkpoint_save.write_snapshot``
        writes and commits the returned snapshot, also from a background thread while training
        goes on (``app/runners/checkpoint.py`` does, by default). See ``engine/checkpoint.py``."""
        from .checkpoint_save import snapshot_checkpoint
        return snapshot_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True, **_kw):
        """Load what :meth:`save_checkpoint` wrote, under this engine's plan, ZeRO stage,
        precision and world size (any of them may differ from the saving job's). Returns
        ``(path, client_state)`` like DeepSpeed. Collective. See ``engine/checkpoint.py``.
        A folder stock DeepSpeed wrote (ZeRO 0/1/2, pp=1) is read too: converted once into
        this format beside its files, then loaded the same way (``interop/checkpoint.py``)."""
        from .checkpoint import load_checkpoint
        from ..interop.checkpoint import is_deepspeed_checkpoint
        from ..interop.checkpoint_import import import_deepspeed

        where = Path(load_dir) / str(tag) if tag is not None else Path(load_dir)
        if is_deepspeed_checkpoint(where):
            load_dir, tag = import_deepspeed(self, load_dir, tag)
        return load_checkpoint(self, load_dir, tag, load_optimizer_states,
                               load_lr_scheduler_states)

    def local_shards(self) -> dict[str, tuple[torch.Tensor, int | None, int, int]]:
        """``name -> (local tensor, TP split dim or None, tp_rank, tp_size)`` for checking and
        gathering: the full tensor's slice ``tp_rank`` of ``tp_size`` along dim. These are the
        live parameters (bf16/fp16 under mixed precision); :meth:`local_state` has the fp32
        masters."""
        out = {}
        for n, p in self.named.items():
            dim = self.param_table[n].split_dim
            out[n] = (p.detach().cpu().clone(), dim, self.tp_rank if dim is not None else 0,
                      self.tp_size if dim is not None else 1)
        return out
