"""``engine=deepspeed``: stock DeepSpeed — the static baseline Malleus is compared with.

- ``pp == 1``: ``DeepSpeedEngine`` with ZeRO stage 0/1/2 (from the ds_config) over all ranks.
- ``pp > 1``: ``PipelineEngine`` over a ``PipelineModule`` of embedding + decoder layers + head,
  a layer list generated from the model's own per-layer builders (``build_layer``: our decoder
  or a Hugging Face model, so initial weights equal the reference; tied embeddings become a
  ``TiedLayerSpec``), partitioned exactly like :func:`malleus_ds.plan.static_plan` (earlier
  stages take the remainder). ZeRO stage <= 1.
- ``tp > 1`` is refused: stock DeepSpeed has no tensor parallelism for this model.
- ``train.activation_checkpointing``: ``PipelineModule(activation_checkpoint_interval=1)`` over
  the decoder layers (DeepSpeed's non-reentrant checkpoint function) for ``pp > 1``;
  ``torch.utils.checkpoint`` per decoder layer (transformers' own switch for a Hugging Face
  model) under ZeRO without a pipeline.

Same math as ``engine=torch``: DeepSpeed scales each micro-batch loss by ``1/GAS`` and averages
gradients over the ``dp`` replicas, i.e. ``Σ_mb loss_mb / (GAS·dp) = Σ_mb loss_mb · mbs / G``, the
global-batch mean. The optimizer is a client ``torch.optim.AdamW`` with the run's
``train.{lr,betas,eps,weight_decay}`` (no JIT-compiled DeepSpeed Adam), unless the ds_config
names its own ``optimizer`` (then DeepSpeed builds it and ``train.lr`` etc. are not used).

Checkpoints (``checkpoint.dir``) are DeepSpeed's own (``engine.save_checkpoint`` /
``load_checkpoint``: module, ZeRO partitions, LR scheduler, counters). Stock DeepSpeed loads them
only under the layout that saved them, so resuming with another world size, tp/pp/dp, ZeRO stage
or precision is a ConfigError before any process group (``app/runners/resume.py``). A universal
checkpoint (``malleus-export --to deepspeed-universal`` wrote it: its run.json says so) loads
under any data-parallel layout: the ds_config gets ``checkpoint.load_universal``, and DeepSpeed's
own ``torch.load`` calls read weights-only while it loads. engine=malleus continues these
checkpoints under any plan (``interop/checkpoint.py`` and its ``checkpoint_*`` readers).
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from torch import nn

from ..config import check_even_batch
from ..run_config import ConfigError, RunConfig
from ...interop.compat import batch_keys
from ...models.base import EMBED, HEAD, lm_loss
from ...models.base import enable_activation_checkpointing, tied_params
from ...plan import even_split
from .base import DistEnv, RunSummary
from ...resilience.agreement import raise_if_any_failed
from .checkpoint import Checkpointer, engine_writer
from .common import (
    ComputeClock,
    StepReporter,
    exclude_calls,
    monitors_to_run_dir,
    replica_micro_batches)


def validate(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.tp != 1:
        raise ConfigError(f"engine=deepspeed: parallel.tp={p.tp} is not supported — stock "
                          f"DeepSpeed has no tensor parallelism for this model; use parallel.tp=1 "
                          f"or engine=malleus for tp>1")
    if p.pp > 1 and cfg.deepspeed.zero_stage > 1:
        raise ConfigError(f"engine=deepspeed with parallel.pp={p.pp}: DeepSpeed's PipelineEngine "
                          f"supports ZeRO stage 0 or 1, the ds_config has zero_optimization.stage="
                          f"{cfg.deepspeed.zero_stage}; use deepspeed=zero1 (or engine=malleus)")
    check_even_batch(cfg.train, p, cfg.deepspeed)
    if cfg.deepspeed.zero_stage == 0 and _resumes_universal(cfg):
        prec = [k for k in ("fp16", "bf16", "bfloat16")
                if (cfg.deepspeed.config.get(k) or {}).get("enabled")]
        if p.pp > 1 or prec:
            what = f"parallel.pp={p.pp}" if p.pp > 1 else f"{prec[0]}"
            raise ConfigError(f"engine=deepspeed: checkpoint {cfg.checkpoint.dir} is a universal "
                              f"checkpoint (malleus-export --to deepspeed-universal), which "
                              f"DeepSpeed continues with ZeRO-1/2, or with ZeRO-0 only in fp32 "
                              f"without a pipeline; this run has ZeRO-0 with {what}: use "
                              f"deepspeed=zero1")


def _resumes_universal(cfg: RunConfig) -> bool:
    """Does this run continue a universal checkpoint (its run.json says so)?"""
    if not cfg.checkpoint.resume or not cfg.checkpoint.dir:
        return False
    from .resume import read_saved

    try:
        saved = read_saved(Path(cfg.checkpoint.dir))
    except ConfigError:
        return False
    return bool(saved is not None and saved.meta.get("universal"))


def build_ds_config(cfg: RunConfig) -> dict:
    """The ds_config handed to ``deepspeed.initialize``: the user's/preset's, plus batch sizes."""
    c = copy.deepcopy(dict(cfg.deepspeed.config))
    t, p = cfg.train, cfg.parallel
    c.update(batch_keys(t.micro_batch_size, t.num_micro_batches // p.dp, p.dp))
    c.setdefault("steps_per_print", 10**9)
    c.setdefault("gradient_clipping", 0.0)
    if _resumes_universal(cfg) and cfg.deepspeed.zero_stage > 0:
        # malleus-export --to deepspeed-universal wrote it; ZeRO-0 reads it as a plain save
        # (DeepSpeed's universal load leaves a run without ZeRO its weights and optimizer from
        # the model-states file, which the export writes as a plain ZeRO-0 save does)
        c["checkpoint"] = dict(c.get("checkpoint") or {}, load_universal=True)
    if "optimizer" not in c:
        c["zero_allow_untested_optimizer"] = True   # our client torch AdamW
    monitors_to_run_dir(c, cfg.run_dir)
    return c


# ---------------------------------------------------------------------------------------------
# pipeline pieces: LayerSpec needs nn.Module classes; each wraps one deterministic layer
# ---------------------------------------------------------------------------------------------


class PipeLayer(nn.Module):
    """One piece of the model for ``PipelineModule`` (EMBED, decoder layer index or HEAD), built
    by the model's own ``build_layer`` (so weights equal the reference's). A decoder layer gets
    the model's per-stage context (rotary tables) itself: DeepSpeed passes one tensor between
    layers."""

    def __init__(self, cfg, layer_id: int, seed: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.run_block, self.block_context = cfg.run_block, cfg.block_context
        self.layer = cfg.build_layer(layer_id, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_id >= 0:
            return self.run_block(self.layer, x, self.block_context(x))
        return self.layer(x)


class PipeBlock(PipeLayer):
    """A decoder layer's piece: the class ``PipelineModule(checkpointable_layers=...)`` names,
    so activation checkpointing recomputes decoder layers and never the embedding or head."""


class PipeFinalNorm(nn.Module):
    """The head piece's final norm alone (a tied model's head is the embedding's weight)."""

    def __init__(self, cfg, seed: int) -> None:
        super().__init__()
        self.norm = cfg.build_layer(HEAD, seed).norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def tied_head(embed: PipeLayer, x: torch.Tensor) -> torch.Tensor:
    """The output projection of a tied model: hidden @ embedding^T (TiedLayerSpec forward_fn)."""
    return torch.nn.functional.linear(x, embed.layer.embed_tokens.weight)


def static_parts(num_layers: int, pp: int, tail: int = 1) -> list[int]:
    """PipelineModule ``parts`` over [embed, block 0..L-1, head pieces] matching ``static_plan``:
    stage s holds blocks even_split(L, pp)[s:s+2], plus the embedding (first) / the ``tail``
    head pieces (last: head, or final norm + tied head)."""
    b = even_split(num_layers, pp)
    return [0] + [b[s] + 1 for s in range(1, pp)] + [num_layers + 1 + tail]


def _build_pipeline_module(cfg: RunConfig):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    m, seed = cfg.model, cfg.train.seed
    blocks = [LayerSpec(PipeBlock, m, i, seed) for i in range(m.num_layers)]
    if tied_params(m):
        # DeepSpeed's own tied-embedding support: one module under key "embed" on the first and
        # last stages, gradients all-reduced between them (PipelineEngine._exec_reduce_tied_grads)
        attr = ["layer.embed_tokens.weight"]
        specs = [TiedLayerSpec("embed", PipeLayer, m, EMBED, seed, tied_weight_attr=attr), *blocks,
                 LayerSpec(PipeFinalNorm, m, seed),
                 TiedLayerSpec("embed", PipeLayer, m, EMBED, seed, forward_fn=tied_head,
                               tied_weight_attr=attr)]
    else:
        specs = [LayerSpec(PipeLayer, m, EMBED, seed), *blocks, LayerSpec(PipeLayer, m, HEAD, seed)]
    tail = len(specs) - 1 - m.num_layers

    class StaticPlanPipelineModule(PipelineModule):
        """PipelineModule partitioned like static_plan (DeepSpeed's 'uniform' counts the
        embedding and head as layers and 'type:' balances differently)."""

        def _partition_layers(self, method="uniform"):
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self.parts = static_parts(m.num_layers, self.num_stages, tail)
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    # activation checkpointing: DeepSpeed's own, one decoder layer per checkpoint, through its
    # non-reentrant function (what ds_config pipeline.use_reentrant=false selects): the same
    # kind of checkpoint as engine=torch and engine=malleus (torch.utils.checkpoint without
    # re-entrance)
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

    ac = cfg.train.activation_checkpointing
    return StaticPlanPipelineModule(layers=specs, num_stages=cfg.parallel.pp, loss_fn=lm_loss,
                                    partition_method="static_plan",
                                    activation_checkpoint_interval=1 if ac else 0,
                                    activation_checkpoint_func=non_reentrant_checkpoint,
                                    checkpointable_layers=[PipeBlock.__name__])


def _time_pipeline_compute(engine, clock: ComputeClock) -> None:
    """Time PipelineEngine's forward/backward instructions (communication is separate
    instructions there) and apply the emulation after each, via an instance copy of its
    instruction table."""
    from deepspeed.runtime.pipe import schedule

    table = dict(type(engine)._INSTRUCTION_MAP)
    for kind in (schedule.ForwardPass, schedule.BackwardPass):
        fn = table[kind]

        def timed(self, *a, _fn=fn, **kw):
            with clock.compute():
                return _fn(self, *a, **kw)

        table[kind] = timed
    engine._INSTRUCTION_MAP = table


def build_engine(cfg: RunConfig, env: DistEnv):
    """``deepspeed.initialize`` on our model: DeepSpeedEngine (pp=1) or PipelineEngine (pp>1)."""
    import warnings

    from ...interop.compat import skip_shm_comm_build

    skip_shm_comm_build()
    import deepspeed

    from ...models import build_model
    from ...optim import make_optimizer

    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")
    deepspeed.init_distributed(dist_backend=env.backend)
    torch.manual_seed(cfg.train.seed)
    ds_cfg = build_ds_config(cfg)
    if cfg.parallel.pp > 1:
        with torch.no_grad():       # its tied-weight broadcast is not a differentiable op
            model = _build_pipeline_module(cfg)
    else:
        model = build_model(cfg.model, cfg.train.seed)
        if cfg.train.activation_checkpointing:      # torch.utils.checkpoint, as engine=torch
            enable_activation_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    client_opt = None if "optimizer" in ds_cfg else make_optimizer(params, cfg.train.optim)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_opt,
                                           model_parameters=params, config=ds_cfg)
    return engine


def instrument(engine, clock: ComputeClock) -> None:
    """Compute timing + straggler emulation on a stock engine, without subclassing it."""
    # gradient reduction that DeepSpeed runs inside backward (ZeRO hooks, the boundary
    # epilogue) is communication, not compute: keep it out of the measured compute time
    exclude_calls(engine, ["allreduce_gradients"], clock)
    exclude_calls(engine.optimizer, ["reduce_ipg_grads"], clock)
    if hasattr(engine, "train_batch"):          # PipelineEngine: time its compute instructions
        _time_pipeline_compute(engine, clock)


def data_parallel_step(engine, data, mbs: list[list[int]], dp: int, env: DistEnv,
                       clock: ComputeClock) -> float:
    """One optimizer step of DeepSpeedEngine over this replica's micro-batches; returns the
    global-batch mean loss (same on every rank)."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64, device=env.device)
    for ids in mbs:
        x, y = (t.to(env.device) for t in data.batch(ids))
        with clock.compute():
            out = lm_loss(engine(x), y)
            engine.backward(out)        # DeepSpeed scales by 1/GAS, averages over dp
        engine.step()                   # steps the optimizer at the GAS boundary only
        total += out.detach().double()
    total /= len(mbs) * dp              # mean of micro-batch means = global mean
    if dp > 1:
        dist.all_reduce(total)
    loss = float(total)
    if engine.monitor.enabled and env.is_rank0:   # PipelineEngine logs its own loss
        engine.monitor.write_events([("Train/Samples/train_loss", loss, engine.global_samples)])
    return loss


def pipeline_step(engine, data, mbs: list[list[int]]) -> float:
    """One PipelineEngine step (1F1B over this pipeline's micro-batches); its returned loss is
    already the mean over micro-batches and data-parallel replicas, on every stage."""
    return float(engine.train_batch(data_iter=iter([data.batch(ids) for ids in mbs])))


def run(cfg: RunConfig, env: DistEnv) -> RunSummary:
    from ...data import build_dataset

    engine = build_engine(cfg, env)
    ck = Checkpointer(cfg, env)
    if ck.resumed is not None:
        from ...interop.compat import load_weights_only, weights_only_loads
        from ...files.safe_load import UnsafeFile

        load_weights_only(engine)           # DeepSpeed's loader would unpickle anything
        err = path = client = None
        try:
            with weights_only_loads():      # DeepSpeed's universal loader calls torch.load
                path, client = engine.load_checkpoint(str(ck.resumed.root), tag=ck.resumed.tag)
        except UnsafeFile as e:
            err = str(e)
        # every rank stops, naming the file (agreement.py: through the store)
        raise_if_any_failed("ds-resume", err, "checkpoint.resume", ConfigError)
        if path is None or (client or {}).get("step") != ck.resumed.step:
            raise ConfigError(f"checkpoint {ck.resumed.path}: DeepSpeed could not load it as the "
                              f"checkpoint of step {ck.resumed.step} (got {path}, client state "
                              f"{client!r})")

    write = engine_writer(engine)

    data = build_dataset(cfg)
    clock = ComputeClock(cfg, env)
    reporter = StepReporter(cfg, env, first_step=ck.start, monitor=engine.monitor)
    instrument(engine, clock)
    pp, dp = cfg.parallel.pp, cfg.parallel.dp
    dp_rank = env.rank % dp  # static_plan: rank = dp_rank + dp * pp_rank (tp=1) = DS pipe topology
    for step in range(ck.start, cfg.train.steps):
        t0 = time.perf_counter()
        clock.start_step(step)
        mbs = replica_micro_batches(cfg, step, dp_rank, dp)
        if pp > 1:
            loss = pipeline_step(engine, data, mbs)
        else:
            loss = data_parallel_step(engine, data, mbs, dp, env, clock)
        reporter.step_done(step, loss, time.perf_counter() - t0, clock)
        ck.after_step(step + 1, write, reporter)
    ck.finish(cfg.train.steps, write, reporter)
    summary = reporter.finish(**ck.summary())
    if hasattr(engine, "destroy"):
        engine.destroy()
    return summary
