#!/usr/bin/env python
"""Stock DeepSpeed ZeRO and Malleus's re-split, side by side, with one rank under a real CPU quota.

One process group of ``--world`` gloo ranks (default 4) trains the same model on the same data
twice per round: ``--loop plain``, a ``deepspeed.initialize`` loop (``engine(x)``,
``engine.backward(loss)``, ``engine.step()``) with stock ``deepspeed.initialize`` and with
``malleus_ds.initialize`` (MalleusDPEngine, the re-split loop on, its default detection);
``--loop trainer``, the Hugging Face ``Trainer`` with a ds_config of "auto" values and
``malleus_ds.hf.MalleusTrainer`` with the same arguments. In each run, rank
``--slow-rank`` is healthy for ``--healthy`` steps, then capped to ``1/--rate`` of a core by a
cgroup (``emulation/cpu_quota.py``: a real slowdown from the OS, every thread of the process,
its communication too) for ``--throttled`` steps, then released for ``--released`` steps. The
same mechanism slows both engines at the same steps; ``--rounds`` alternate which engine goes
first.

Printed, per engine: samples/s in each phase (the mean over the phase's steps, every step of it:
detection and re-split included), and the ratios the issue sets targets for:

* throttled: malleus / stock samples/s (target >= 1.5);
* released: the steps malleus needs after the release to run at >= 0.85 of its healthy pace,
  three steps in a row on average (target <= 10);
* healthy: malleus / stock samples/s (target >= 0.97);
* the largest relative difference of a step's global-batch loss between the two (target <=
  1e-4).

    python bench/bench_zero.py                       # 4 ranks, ZeRO-3, the plain loop
    python bench/bench_zero.py --stage 2 --rounds 2
    python bench/bench_zero.py --loop trainer --dim 256 --global-batch 32
    python bench/bench_zero.py --slowdown sleep      # compute-only slowdown (a slow GPU)

Needs root and the cgroup cpu controller (``python -m malleus_ds.emulation.cpu_quota
--calibrate`` says whether this machine has them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _config(a) -> dict:
    return {"train_batch_size": a.global_batch, "gradient_accumulation_steps": a.gas,
            "train_micro_batch_size_per_gpu": a.global_batch // (a.gas * a.world),
            "zero_optimization": {"stage": a.stage}, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}


class _Data:
    """A fixed synthetic regression: ``n`` samples of ``dim`` inputs, the same in every rank."""

    def __init__(self, n: int, dim: int):
        import torch

        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.tanh(self.x[:, :8] * 1.5)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _model(dim: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(dim, 8))


class _SlowCompute:
    """The compute-only slowdown (``--slowdown sleep``): while ``rate`` > 1, each leaf module's
    forward on this rank is followed by a sleep of ``(rate - 1) * 3`` times its seconds (its
    backward taken as twice its forward), so the rank computes ``rate`` times slower and
    communicates as fast as ever: a slow GPU, where the quota also slows the rank's share of
    every gloo collective. Attached after the engine is built, so ZeRO-3's parameter fetch
    (its own forward pre-hooks) runs before the clock starts."""

    def __init__(self):
        self.rate = 1.0
        self._t0 = 0.0

    def attach(self, model) -> None:
        for m in model.modules():
            if not list(m.children()):
                m.register_forward_pre_hook(self._pre)
                m.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        if self.rate > 1.0 and module.training:
            time.sleep((self.rate - 1.0) * 3.0 * (time.perf_counter() - self._t0))

    def set_rate(self, rate: float) -> None:
        self.rate = rate


class _ExtraAllReduce:
    """What the re-split loop adds to a step, without the loop: one non-blocking all-reduce of
    its vector's size (3 x world + 1 float64), issued at each step's end and waited for at the
    next (``bench_dp_loop.py``'s "stock+ar": how much of the loop's cost is that collective)."""

    def __init__(self, world: int):
        self.world, self.work = world, None

    def step(self) -> None:
        import torch
        import torch.distributed as dist

        t = torch.zeros(3 * self.world + 1, dtype=torch.float64)
        work = dist.all_reduce(t, async_op=True)
        if self.work is not None:
            self.work.wait()
        self.work = work

    def close(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


def _run(engine_name: str, a, slower, rank: int) -> dict:
    """One run of the plain loop under ``engine_name``; each step's wall seconds and loss."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import malleus_ds

    total = a.healthy + a.throttled + a.released
    data = _Data(a.global_batch * total, a.dim)
    m = _model(a.dim, a.layers)
    if engine_name == "stock":
        eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                 training_data=data, config=_config(a))
        loader.num_local_io_workers = 0

        def global_loss(losses):
            t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t) / dist.get_world_size()
    else:
        cfg = {**_config(a), "malleus": {"adaptive": False}} if a.no_loop else _config(a)
        eng, _, loader, _ = malleus_ds.initialize(model=m, model_parameters=m.parameters(),
                                                  training_data=data, config=cfg)
        global_loss = eng.global_loss
    if isinstance(slower, _SlowCompute):     # after ZeRO-3's fetch hooks: compute only
        slower.attach(eng.module)
    it = iter(loader)
    times, losses, shares = [], [], []
    extra = _ExtraAllReduce(dist.get_world_size()) if getattr(a, "extra_allreduce", False) \
        else None
    dist.barrier()
    for step in range(total):
        slow = a.healthy <= step < a.healthy + a.throttled
        if slower is not None:
            slower.set_rate(a.rate if slow else 1.0)
        t0 = time.perf_counter()
        mine = []
        for _ in range(a.gas):
            b = next(it)
            loss = F.mse_loss(eng(b["x"]), b["y"])
            eng.backward(loss)
            eng.step()
            mine.append(loss.item())
        if extra is not None:
            extra.step()
        losses.append(global_loss(mine))
        times.append(time.perf_counter() - t0)
        shares.append(list(eng.split.shares) if engine_name == "malleus" else None)
    if slower is not None:
        slower.set_rate(1.0)
    if extra is not None:
        extra.close()
    return {"times": times, "losses": losses, "shares": shares,
            "events": list(getattr(eng, "split_events", []))}


class _Tokens:
    """``n`` random token sequences of ``seq`` tokens, labels = inputs, the same in every rank."""

    def __init__(self, n: int, seq: int, vocab: int):
        import torch

        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_config(a) -> dict:
    """A Hugging Face ds_config with "auto" values, as users bring one."""
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": a.stage},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                      "torch_adam": True}},
            "steps_per_print": 10**9}


def _run_trainer(engine_name: str, a, slower, rank: int) -> dict:
    """One ``transformers.Trainer`` (stock) or ``MalleusTrainer`` run of a small Llama; each
    optimizer step's wall seconds and logged loss."""
    import tempfile

    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    from malleus_ds.hf import MalleusTrainer

    total = a.healthy + a.throttled + a.released
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.dim * 8 // 3,
        num_hidden_layers=a.layers, num_attention_heads=max(1, a.dim // 64),
        num_key_value_heads=max(1, a.dim // 64), max_position_embeddings=a.seq))
    out = {"times": [], "losses": [], "shares": [], "events": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            if isinstance(slower, _SlowCompute):  # after ZeRO-3's fetch hooks: compute only
                slower.attach(model)

        def on_step_begin(self, args, state, control, **kw):
            if slower is not None:
                throttled = a.healthy <= state.global_step < a.healthy + a.throttled
                slower.set_rate(a.rate if throttled else 1.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            out["times"].append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                out["losses"].append(logs["loss"])

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=a.global_batch // (a.gas * a.world),
            gradient_accumulation_steps=a.gas, max_steps=total, logging_steps=1,
            learning_rate=1e-3, max_grad_norm=1.0, deepspeed=_trainer_config(a),
            save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0)
        cls = Trainer if engine_name == "stock" else MalleusTrainer
        trainer = cls(model=model, args=args, callbacks=[Clock()],
                      train_dataset=_Tokens(a.global_batch * total, a.seq, a.vocab))
        trainer.train()
        eng = trainer.model_wrapped
        out["events"] = list(getattr(eng, "split_events", []))
    if slower is not None:
        slower.set_rate(1.0)
    return out


def _ranks(rank, world, a):
    from malleus_ds.emulation.cpu_quota import CpuQuota

    slower = None
    if rank == a.slow_rank:
        slower = CpuQuota() if a.slowdown == "quota" else _SlowCompute()
    try:
        out = []
        for r in range(a.rounds):
            order = ("stock", "malleus") if r % 2 == 0 else ("malleus", "stock")
            run = _run_trainer if a.loop == "trainer" else _run
            out.append({e: run(e, a, slower, rank) for e in order})
        return out
    finally:
        if isinstance(slower, CpuQuota):
            slower.close()


def _phase_rates(times, a) -> dict:
    """Samples/s over each phase's steps (total samples / total seconds)."""
    h, t = a.healthy, a.throttled
    parts = {"healthy": times[1:h], "throttled": times[h:h + t], "released": times[h + t:]}
    return {k: a.global_batch * len(v) / sum(v) for k, v in parts.items()}


def _recovery_steps(times, a, healthy_sps, span: int = 3) -> int | None:
    """Steps after the release until the pace holds at >= 0.85 of the healthy one: the first
    released step from which ``span`` steps in a row run at that pace on average (1 = the first
    released step); None: never."""
    after = times[a.healthy + a.throttled:]
    for i in range(len(after) - span + 1):
        if a.global_batch * span / sum(after[i:i + span]) >= 0.85 * healthy_sps:
            return i + 1
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--rate", type=float, default=10.0, help="the quota: 1/RATE of a core")
    ap.add_argument("--slowdown", choices=("quota", "sleep"), default="quota",
                    help="quota: a real cgroup CPU cap (compute and communication); sleep: "
                         "compute only (each leaf module's forward, and its backward's share)")
    ap.add_argument("--healthy", type=int, default=10)
    ap.add_argument("--throttled", type=int, default=20)
    ap.add_argument("--released", type=int, default=15)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--loop", choices=("plain", "trainer"), default="plain",
                    help="plain: a deepspeed.initialize loop of an MLP (--dim, --layers); "
                         "trainer: the Hugging Face Trainer (stock vs MalleusTrainer) of a "
                         "small Llama (--dim hidden, --layers, --seq, --vocab)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--no-loop", action="store_true",
                    help="malleus.adaptive false: MalleusDPEngine without the re-split loop "
                         "(the engine's own overhead; plain loop only)")
    ap.add_argument("--json", help="write every step's times, losses and shares here")
    a = ap.parse_args()
    from malleus_ds.emulation.cpu_quota import unavailable_reason

    why = unavailable_reason() if a.slowdown == "quota" else None
    if why:
        print(f"bench_zero: no real CPU quota on this machine: {why}", file=sys.stderr)
        return 2
    from tests.integration.harness import run_distributed

    t0 = time.time()
    res = run_distributed(_ranks, a.world, a, timeout=3600)[0]
    what = (f"the HF Trainer, Llama {a.layers} layers x {a.dim}, seq {a.seq}"
            if a.loop == "trainer" else f"a deepspeed.initialize loop, MLP {a.layers}x{a.dim}")
    print(f"bench_zero: {a.world} ranks, ZeRO-{a.stage}, global batch {a.global_batch} "
          f"(gas {a.gas}), {what}; rank {a.slow_rank} "
          f"{'at 1/%g of a core' % a.rate if a.slowdown == 'quota' else 'computing %gx slower' % a.rate} "
          f"for steps {a.healthy}-{a.healthy + a.throttled - 1}; {a.rounds} round(s), "
          f"{time.time() - t0:.0f} s")
    rows = []
    for r, rnd in enumerate(res):
        st, ml = _phase_rates(rnd["stock"]["times"], a), _phase_rates(rnd["malleus"]["times"], a)
        diff = max(abs(x - y) / abs(y) for x, y in zip(rnd["malleus"]["losses"],
                                                        rnd["stock"]["losses"]))
        rec = _recovery_steps(rnd["malleus"]["times"], a, ml["healthy"])
        rows.append((st, ml, diff, rec))
        first = "stock" if r % 2 == 0 else "malleus"
        print(f"\nround {r + 1} ({first} first)   samples/s: healthy / throttled / released")
        for name, v in (("stock", st), ("malleus", ml)):
            print(f"  {name:8s} {v['healthy']:8.1f} {v['throttled']:10.1f} {v['released']:9.1f}")
        ev = rnd["malleus"]["events"]
        print(f"  re-splits: " + "; ".join(f"step {e['step']}: {e['from']} -> {e['to']}"
                                          for e in ev) if ev else "  re-splits: none")
    st_t = statistics.median(x[1]["throttled"] / x[0]["throttled"] for x in rows)
    st_h = statistics.median(x[1]["healthy"] / x[0]["healthy"] for x in rows)
    recs = [x[3] for x in rows]
    diff = max(x[2] for x in rows)
    print(f"\nmalleus / stock while throttled: {st_t:.2f}x (target >= 1.5)")
    print(f"malleus / stock healthy:         {st_h:.3f} (target >= 0.97)")
    print(f"steps after the release to >= 0.85 of healthy: {recs} (target <= 10)")
    print(f"largest relative loss difference per step: {diff:.2e} (target <= 1e-4)")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rounds": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
