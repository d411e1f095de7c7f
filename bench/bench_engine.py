#!/usr/bin/env python
"""MalleusEngine vs stock DeepSpeed on the same static layout, no stragglers, side by side.

Two layouts on 2 local CPU ranks (gloo), each in one process group, engines built once and timed
in alternating rounds (stock, malleus, stock, malleus, ...) so machine noise hits both alike:

* ``dp2``: ZeRO-1 data parallel over 2 replicas — stock ``DeepSpeedEngine`` (client torch
  AdamW, ZeRO stage 1) vs MalleusEngine on ``static_plan(tp=1, pp=1, dp=2)``, ZeRO-1;
* ``pp2``: 2 pipeline stages — stock ``PipelineEngine`` (partition 'uniform' over
  embed + L blocks + head, identical to static_plan's) vs MalleusEngine on
  ``static_plan(tp=1, pp=2, dp=1)``.

``--model hf:<preset>`` (``hf:small-llama``, ``hf:tiny-qwen2-tied``, ... any of
``malleus_ds.models.hf.HF_PRESETS``) runs a Hugging Face Llama-family model instead: MalleusEngine
gets the ``HFModel`` of :func:`~malleus_ds.models.hf.load_hf_model`; stock dp2 trains
transformers' own ``<Family>ForCausalLM`` (``HFModel.build_reference``, tokens -> logits) and
stock pp2 the ``PipelineModule`` the ``engine=deepspeed`` runner generates from the model's
``build_layer`` (``PipeLayer`` per piece, ``TiedLayerSpec`` for tied embeddings, partitioned like
static_plan). Our own models (``--model small`` ...) keep the 'uniform' PipelineModule above.

Reported: median step time of each engine over the timed steps and the ratio malleus/stock
(target <= 1.10). Both engines train the same model from the same init on the same batches: the
first-step global-batch losses of both are printed, and the largest loss difference over all
steps both ran (each engine runs the same step indices on the same batches).

``--recompute``: activation checkpointing instead, each engine with and without it
(``train.activation_checkpointing``: stock DeepSpeed with ``torch.utils.checkpoint`` per layer
under ZeRO, the runner's ``PipelineModule(activation_checkpoint_interval=1)`` for pp2;
MalleusEngine with the ds_config's ``activation_checkpointing`` section), four engines taking
one step each in turn (``rounds x steps`` timed steps each, after ``warmup``). Reported per engine: median step time off / on, and the peak tensor memory
of one step (the most over the ranks, above what the rank held before the step: activations,
gradients, temporaries), measured once per engine outside the timed steps: on CUDA
``max_memory_allocated``, on CPU the allocator's events (``tests/peak_memory.py``). The losses
with and without recompute must agree.

    python bench/bench_engine.py                 # ~1-2 min on 2 CPU cores
    python bench/bench_engine.py --model small --seq 64 --steps 6 --rounds 3
    python bench/bench_engine.py --model hf:small-llama --rounds 10 --steps 3   # ~3 min
    python bench/bench_engine.py --recompute --seq 256 --rounds 3 --steps 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _load_model(model_name: str, seq: int):
    """``small`` / ``medium`` ...: our decoder (ModelConfig); ``hf:<preset>``: an HFModel."""
    if model_name.startswith("hf:"):
        from malleus_ds.models.hf import load_hf_model
        return load_hf_model(model_name[3:], max_seq_len=seq)
    from malleus_ds.models import model_config
    return model_config(model_name, max_seq_len=seq)


def _is_hf(cfg) -> bool:
    return getattr(cfg, "family", None) == "hf"


def _hf_pipeline_module(cfg, seed, pp, ac=False):
    """The runner's generated PipelineModule (``_build_pipeline_module`` reads only
    ``cfg.model``, ``cfg.train.seed``, ``cfg.train.activation_checkpointing`` and
    ``cfg.parallel.pp`` of a RunConfig)."""
    from types import SimpleNamespace

    from malleus_ds.app.runners.deepspeed_runner import _build_pipeline_module

    run_cfg = SimpleNamespace(model=cfg, train=SimpleNamespace(seed=seed,
                                                               activation_checkpointing=ac),
                              parallel=SimpleNamespace(pp=pp))
    return _build_pipeline_module(run_cfg)


def _stock_engine(layout, cfg, G, mbs, seed, ac=None):
    """Stock DeepSpeed on ``layout``. ``ac`` (True/False, ``--recompute``): the engine=deepspeed
    runner's own model for the layout, with or without activation checkpointing; None: the
    model the plain comparison has always used."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from malleus_ds.models import build_model
    from malleus_ds.models.llama import EMBED, HEAD, lm_loss
    from malleus_ds.optim import OptimConfig, make_optimizer
    from malleus_ds.app.runners.deepspeed_runner import PipeLayer

    ds = {"train_batch_size": G, "train_micro_batch_size_per_gpu": mbs,
          "gradient_accumulation_steps": G // mbs // (2 if layout == "dp2" else 1),
          "gradient_clipping": 0.0, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    if ac is not None:      # --recompute: ZeRO's gradient buckets (5e8 elements by default, 2 GB
        # allocated in every step here) would hide the activations the peak is about
        ds["zero_optimization"].update(reduce_bucket_size=500_000, allgather_bucket_size=500_000)
    if layout == "dp2":
        model = cfg.build_reference(seed) if _is_hf(cfg) else build_model(cfg, seed)
        if ac:
            from malleus_ds.models.base import enable_activation_checkpointing
            enable_activation_checkpointing(model)
    elif _is_hf(cfg) or ac is not None:
        model = _hf_pipeline_module(cfg, seed, 2, bool(ac))
    else:
        specs = [LayerSpec(PipeLayer, cfg, i, seed) for i in [EMBED, *range(cfg.num_layers), HEAD]]
        model = PipelineModule(layers=specs, num_stages=2, loss_fn=lm_loss,
                               partition_method="uniform", activation_checkpoint_interval=0)
    params = [p for p in model.parameters()]
    opt = make_optimizer(params, OptimConfig())
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=params, config=ds)
    return eng


def _worker(rank, world, layout, model_name, seq, G, steps, rounds, warmup):
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups

    from malleus_ds.data import ByteCorpus
    from malleus_ds.interop.compat import init_deepspeed_comm
    from malleus_ds.engine.engine import MalleusEngine
    from malleus_ds.models.llama import lm_loss
    from malleus_ds.plan import static_plan
    from malleus_ds.app.reference import micro_batches

    cfg = _load_model(model_name, seq)
    mbs, seed = 1, 0
    data = ByteCorpus(seq, seed=seed)
    init_deepspeed_comm()
    stock = _stock_engine(layout, cfg, G, mbs, seed)
    stock_mpu = groups.mpu
    pp, dp = (1, 2) if layout == "dp2" else (2, 1)
    plan = static_plan(cfg.num_layers, G, mbs, tp=1, pp=pp, dp=dp)
    ds = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    mal = MalleusEngine(cfg, ds, plan, data=data)
    mal_mpu = groups.mpu
    from malleus_ds.adaptive.settings import AdaptiveSettings
    from malleus_ds.app.loop import attach_loop
    attach_loop(mal, AdaptiveSettings())        # as malleus_ds.initialize does: the loop's cost in

    def stock_step(step):
        mbl = micro_batches(step, G, mbs)
        if layout == "pp2":
            return float(stock.train_batch(data_iter=iter([data.batch(ids) for ids in mbl])))
        mine = mbl[rank * len(mbl) // 2:(rank + 1) * len(mbl) // 2]   # static_plan's split
        total = 0.0
        for ids in mine:
            x, y = data.batch(ids)
            loss = lm_loss(stock(x), y)
            stock.backward(loss)
            stock.step()
            total += loss.item()
        return total / len(mine)        # this replica's mean; averaged over replicas below

    times = {"stock": [], "malleus": []}
    losses = {"stock": [], "malleus": []}
    step = {"stock": 0, "malleus": 0}
    for r in range(rounds):
        for name in ("stock", "malleus"):
            groups.mpu = stock_mpu if name == "stock" else mal_mpu
            for k in range(steps + (warmup if r == 0 else 0)):
                dist.barrier()
                t0 = time.perf_counter()
                if name == "stock":
                    loss = stock_step(step[name])
                else:
                    loss = mal.train_batch(step=step[name])
                losses[name].append(loss)
                dist.barrier()
                dt = time.perf_counter() - t0
                step[name] += 1
                if r > 0 or k >= warmup:
                    times[name].append(dt)
    if layout == "dp2":                 # stock dp2 losses: per replica -> global-batch mean
        t = torch.tensor(losses["stock"], dtype=torch.float64)
        dist.all_reduce(t)
        losses["stock"] = (t / 2).tolist()
    return {"times": times, "losses": losses}


def _recompute_worker(rank, world, layout, model_name, seq, G, steps, rounds, warmup):
    """``--recompute``: stock and MalleusEngine, each without and with activation
    checkpointing, in one process group; alternating timed rounds, then one step of each under
    the memory measurement. Returns this rank's times, losses and peaks per engine."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from malleus_ds.data import ByteCorpus
    from malleus_ds.interop.compat import init_deepspeed_comm
    from malleus_ds.engine.engine import MalleusEngine
    from malleus_ds.models.llama import lm_loss
    from malleus_ds.plan import static_plan
    from malleus_ds.app.reference import micro_batches
    from tests.peak_memory import peak_tensor_mb

    cfg = _load_model(model_name, seq)
    mbs, seed = 1, 0
    data = ByteCorpus(seq, seed=seed)
    init_deepspeed_comm()
    pp, dp = (1, 2) if layout == "dp2" else (2, 1)
    plan = static_plan(cfg.num_layers, G, mbs, tp=1, pp=pp, dp=dp)
    engines, mpus = {}, {}
    for ac in (False, True):
        groups.mpu = None       # stock builds none: it must not find a MalleusEngine's there
        engines[("stock", ac)] = _stock_engine(layout, cfg, G, mbs, seed, ac=ac)
        mpus[("stock", ac)] = groups.mpu
        ds = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "malleus": {"adaptive": False},   # the layout stays
              **({"activation_checkpointing": {}} if ac else {})}
        engines[("malleus", ac)] = MalleusEngine(cfg, ds, plan, data=data)
        assert engines[("malleus", ac)].settings.recompute is ac
        mpus[("malleus", ac)] = groups.mpu

    def run_step(key, step):
        eng = engines[key]
        if key[0] == "malleus":
            return eng.train_batch(step=step)
        mbl = micro_batches(step, G, mbs)
        if layout == "pp2":
            return float(eng.train_batch(data_iter=iter([data.batch(ids) for ids in mbl])))
        total = 0.0
        for ids in mbl[rank * len(mbl) // 2:(rank + 1) * len(mbl) // 2]:
            x, y = data.batch(ids)
            loss = lm_loss(eng(x), y)
            eng.backward(loss)
            eng.step()
            total += loss.item()
        return total / (len(mbl) // 2)   # this replica's mean (dp2: summed over ranks below)

    keys = list(engines)
    times = {k: [] for k in keys}
    losses = {k: [] for k in keys}
    for k in range(warmup + rounds * steps):    # one step of each engine in turn: a busy
        for key in keys:                        # spell on a shared machine hits all four
            groups.mpu = mpus[key]
            dist.barrier()
            t0 = time.perf_counter()
            losses[key].append(run_step(key, len(losses[key])))
            dist.barrier()
            if k >= warmup:
                times[key].append(time.perf_counter() - t0)
    peaks = {}
    for key in keys:                    # one more step each, under the memory measurement
        groups.mpu = mpus[key]
        dist.barrier()
        step = len(losses[key])
        peaks[key] = peak_tensor_mb(lambda: losses[key].append(run_step(key, step)))
    if layout == "dp2":
        import torch

        for key in keys:
            if key[0] == "stock":
                t = torch.tensor(losses[key], dtype=torch.float64)
                dist.all_reduce(t)
                losses[key] = (t / 2).tolist()
    return {"times": times, "losses": losses, "peaks": peaks}


def recompute_main(a) -> int:
    from tests.integration.harness import run_distributed

    print(f"model={a.model} seq={a.seq} G={a.global_batch} mbs=1, 2 CPU ranks (gloo), "
          f"{a.rounds * a.steps} timed steps per engine, one step of each engine in turn, "
          f"median step time; activation checkpointing off / on")
    print(f"{'layout':7} {'engine':8} {'step s off':>10} {'on':>8} {'on/off':>7}   "
          f"{'peak MB off':>11} {'on':>8} {'on/off':>7}   max|dloss| off vs on")
    for layout in a.layouts.split(","):
        res = run_distributed(_recompute_worker, 2, layout, a.model, a.seq, a.global_batch,
                              a.steps, a.rounds, a.warmup, timeout=1800)
        for eng in ("stock", "malleus"):
            t = [statistics.median(res[0]["times"][(eng, ac)]) for ac in (False, True)]
            mem = [max(r["peaks"][(eng, ac)] for r in res) for ac in (False, True)]
            ls = [res[0]["losses"][(eng, ac)] for ac in (False, True)]
            dmax = max(abs(x - y) for x, y in zip(*ls))
            print(f"{layout:7} {eng:8} {t[0]:10.4f} {t[1]:8.4f} {t[1] / t[0]:7.3f}   "
                  f"{mem[0]:11.1f} {mem[1]:8.1f} {mem[1] / mem[0]:7.3f}   {dmax:.2e} over "
                  f"{len(ls[0])} steps")
    print("step on/off: the recompute's cost (the cost model charges 4/3 per layer); peak "
          "on/off: what a layer keeping only its input saves")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dp2,pp2")
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per engine per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", action="store_true",
                    help="each engine with and without activation checkpointing: step time "
                         "and peak memory")
    a = ap.parse_args()
    if a.recompute:
        return recompute_main(a)
    from tests.integration.harness import run_distributed

    cfg = _load_model(a.model, a.seq)
    print(f"model={a.model} ({cfg!r}) " if a.model.startswith("hf:") else f"model={a.model} ",
          end="")
    print(f"seq={a.seq} G={a.global_batch} mbs=1, 2 CPU ranks (gloo), "
          f"{a.rounds} alternating rounds x {a.steps} steps, median step time")
    print(f"{'layout':8} {'stock s':>9} {'malleus s':>10} {'ratio':>7}   "
          f"{'1st-step loss stock':>19} {'malleus':>10}  max|dloss|")
    worst = 0.0
    for layout in a.layouts.split(","):
        res = run_distributed(_worker, 2, layout, a.model, a.seq, a.global_batch, a.steps,
                              a.rounds, a.warmup, timeout=1800)[0]
        t, ls = res["times"], res["losses"]
        s, m = statistics.median(t["stock"]), statistics.median(t["malleus"])
        worst = max(worst, m / s)
        dmax = max(abs(x - y) for x, y in zip(ls["stock"], ls["malleus"]))
        print(f"{layout:8} {s:9.4f} {m:10.4f} {m / s:7.3f}   {ls['stock'][0]:19.6f} "
              f"{ls['malleus'][0]:10.6f}  {dmax:.2e} over {len(ls['stock'])} steps")
    print(f"worst ratio malleus/stock = {worst:.3f} ({'within' if worst <= 1.10 else 'OVER'} 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
