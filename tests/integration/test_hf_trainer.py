"""``malleus_ds.hf.MalleusTrainer`` on gloo ranks equals the stock ``transformers.Trainer`` under
DeepSpeed ZeRO-1, 2 and 3.

A tiny Llama (built from its config, nothing downloaded), 24 token sequences (3 optimizer steps an
epoch, so 4 steps cross an epoch), the same ``TrainingArguments`` and ds_config (a dict, or a JSON
file's path; ``"auto"`` values, the ds_config's AdamW, clipping that bites, 2 micro-batches of 2
per rank): the stock Trainer, against MalleusTrainer with a fixed uneven split (3 + 1 samples per
micro-batch: rank 1 at the minimum share), with ``average_tokens_across_devices`` on (labels partly
masked, so the global token normalisation matters: loss kind ``"global"``) and off (``"mean"``). In
fp32 the per-step logged losses and gradient norms agree to rtol 1e-5, the final parameters to rtol
1e-5 plus 1e-5 of each tensor's scale, and ``metrics.jsonl``'s loss (``malleus.metrics_dir``) is
the logged one; in bf16 (the Trainer's SGD, see :data:`SGD`), to bf16's rounding. A re-split
mid-run (by the loop's decision, and by ``set_split`` from a callback's ``on_step_end``) keeps them
equal; ``set_split`` after the Trainer fetched the step's batches is refused. A checkpoint the
stock Trainer saved resumes in MalleusTrainer and the reverse (ZeRO-3), both ending where the stock
run ends. One 2-rank ``run_distributed`` call runs every Trainer and one test checks all of it
(:data:`TWO_RANK_CHECKS`, each failure named); one 4-rank call checks ZeRO-3 with a 1 + 3 + 2 + 2
split (SGD).

One test reads timings (``tests/conftest.py`` ALONE_TESTS), in its own 2-rank call: the
ds_config's ``malleus`` section as ``malleus_ds.initialize`` reads it, the re-split loop on by
default, rank 1 emulated 4x slower from step 2: the split moves samples off rank 1 (asserted by
direction only) and the losses and parameters stay the stock Trainer's.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile

import numpy as np
import pytest

from tests.integration.harness import run_distributed

#: the shared 2-rank run (25 Trainers): 28-37 s on 2 cores shared with other work (load ~4)
pytestmark = pytest.mark.slow

STAGES, STEPS, MBS, GAS, N, SEQ, VOCAB = (1, 2, 3), 4, 2, 2, 24, 8, 32
UNEVEN, FLIPPED = (3, 1), (1, 3)
#: the 4-rank run: a global batch of 16 in 2 micro-batches of 8, rank 0 at the minimum share
UNEVEN4 = (1, 3, 2, 2)
#: the Trainer's own SGD (given to DeepSpeed as a client optimizer) for the bf16 and 4-rank runs:
#: Adam divides each gradient by its running magnitude, so where a gradient is near zero (the
#: attention projections at initialisation) rounding in the partial sums decides the size and
#: sign of its step. Measured with AdamW at lr 5e-2: bf16 q/k projections 45% of their scale
#: apart after 4 steps, fp32 on 4 ranks 3e-5; with SGD, bf16 within about one bf16 ulp of the
#: tensor's scale and fp32 on 4 ranks 6e-8 (the gradients agree; the optimizer amplifies)
SGD = {"optim": "sgd", "learning_rate": 0.2}


def _ds_config(stage):
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                      "torch_adam": True}},
            "steps_per_print": 10**9}


class _Tokens:
    """``n`` token sequences with their labels, the same in every process; ``masked``: each
    sequence's labels masked (-100) from a random point on, so sequences carry unequal label
    counts."""

    def __init__(self, n: int = N, masked: bool = False):
        import torch

        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = self.ids.clone()
        if masked:
            keep = torch.randint(2, SEQ + 1, (n,), generator=g)
            for i in range(n):
                self.labels[i, keep[i]:] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, max_position_embeddings=SEQ))


def _plain():
    """The same tiny Llama in a module whose ``forward`` takes no loss keywords, so the Trainer
    divides its mean loss by the accumulation steps itself (no ``num_items_in_batch``): loss
    kind ``"mean"`` whatever ``average_tokens_across_devices`` says."""
    import torch

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = _llama()

        def forward(self, input_ids, labels):
            return {"loss": self.lm(input_ids=input_ids, labels=labels).loss}

    return Plain()


class _Collate:
    """The Trainer's default collator, recording each micro-batch's size."""

    def __init__(self):
        self.sizes = []

    def __call__(self, features):
        from transformers import default_data_collator

        self.sizes.append(len(features))
        return default_data_collator(features)


def _callbacks():
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        """Each logged step's loss and gradient norm."""

        def __init__(self):
            self.losses, self.norms = [], []

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])
                self.norms.append(logs["grad_norm"])

    class Act(TrainerCallback):
        """Runs ``fn(trainer, global_step)`` at one of the Trainer's events."""

        def __init__(self, event, fn):
            self.trainer = None
            setattr(self, event, lambda args, state, control, **kw: fn(self.trainer,
                                                                     state.global_step))

    return Record, Act


class _FlipAt:
    """A re-split policy (``dp.loop.SplitPolicy``) deciding once, after step ``step``: flipped."""

    def __init__(self, step, world=2):
        self.step, self.world = step, world

    def decide(self, step, seconds_per_sample, split):
        from malleus_ds.dp.split import Split

        if step == self.step:
            return Split(FLIPPED, GAS), [1.0] * self.world
        return None


def _params(engine):
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}


def _train(root, name, stage, avg, *, ours=False, split=None, malleus=None, bf16=False,
           save=False, resume=None, act=None, n=N, model=_llama, masked=None, as_file=False,
           **training_args):
    """One Trainer run (stock, or ``ours``: MalleusTrainer with ``split`` and the ds_config's
    ``malleus`` section); ``act``: (event, fn) for a callback; ``resume``: a checkpoint folder;
    ``masked``: partly masked labels (default: with ``avg``, average_tokens_across_devices);
    ``as_file``: the ds_config given as the path of a JSON file."""
    from transformers import Trainer, TrainingArguments

    from malleus_ds.hf import MalleusTrainer

    Record, Act = _callbacks()
    cfg = _ds_config(stage)
    if training_args.get("optim"):          # the Trainer's own optimizer, given to DeepSpeed
        del cfg["optimizer"]
    if malleus is not None:
        cfg["malleus"] = malleus
    if as_file:
        path = os.path.join(root, f"{name}-rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        cfg = path
    args = TrainingArguments(**{
        "output_dir": os.path.join(root, name), "per_device_train_batch_size": MBS,
        "gradient_accumulation_steps": GAS, "max_steps": STEPS, "logging_steps": 1,
        "learning_rate": 1e-2, "weight_decay": 0.01, "max_grad_norm": 0.5,
        "average_tokens_across_devices": avg, "bf16": bf16, "deepspeed": cfg,
        "save_strategy": "steps" if save else "no", "save_steps": 2, "report_to": [],
        "disable_tqdm": True, "use_cpu": True, "seed": 42, **training_args})
    rec, collate = Record(), _Collate()
    calls = [rec]
    if act is not None:
        calls.append(Act(*act))
    kw = {"split": split} if ours else {}
    trainer = (MalleusTrainer if ours else Trainer)(
        model=model(), args=args, data_collator=collate,
        train_dataset=_Tokens(n, masked=avg if masked is None else masked),
        callbacks=calls, **kw)
    for c in calls[1:]:
        c.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    eng = trainer.model_wrapped
    return {"losses": rec.losses, "norms": rec.norms, "params": _params(eng),
            "sizes": collate.sizes, "engine": type(eng).__name__,
            "events": list(getattr(eng, "split_events", [])),
            "dir": os.path.join(root, name)}


def _refused_mid_fetch(root):
    """set_split in on_step_begin (after the Trainer fetched the step's batches): refused."""
    from malleus_ds.dp.split import Split

    def flip(trainer, step):
        if step == 2:
            trainer.model_wrapped.set_split(Split(FLIPPED, GAS))

    try:
        _train(root, "refused", 1, False, ours=True, split=Split(UNEVEN, GAS),
               act=("on_step_begin", flip))
    except RuntimeError as e:
        return str(e)
    return None


def _refused_iterable(root):
    import torch
    from transformers import TrainingArguments

    from malleus_ds.hf import MalleusTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    args = TrainingArguments(output_dir=os.path.join(root, "iterable"), max_steps=STEPS,
                             per_device_train_batch_size=MBS, deepspeed=_ds_config(2),
                             report_to=[], use_cpu=True)
    try:
        MalleusTrainer(model=_llama(), args=args, train_dataset=Stream())
    except ValueError as e:
        return str(e)
    return None


def _ranks(rank, world, root):
    from malleus_ds.dp.split import Split

    uneven = Split(UNEVEN, GAS)
    out = {}
    for stage in STAGES:
        for avg in (True, False):
            save = stage == 3 and avg
            tag = f"z{stage}{'g' if avg else 'm'}"
            out[stage, avg, "stock"] = _train(root, f"{tag}-stock", stage, avg, save=save)
            mal = {"adaptive": False, "metrics_dir": os.path.join(root, tag, "metrics")}
            if stage == 2 and not avg:
                mal["straggler"] = [{"rank": 1, "rate": 2.0, "start_step": 2}]
            out[stage, avg, "ours"] = _train(root, f"{tag}-ours", stage, avg, ours=True,
                                             split=uneven, malleus=mal, save=save)
        out[stage, "stock-bf16"] = _train(root, f"z{stage}-stock-bf16", stage, True, bf16=True,
                                          **SGD)
        out[stage, "ours-bf16"] = _train(root, f"z{stage}-ours-bf16", stage, True, bf16=True,
                                         ours=True, split=uneven, **SGD)

    out["plain", "stock"] = _train(root, "plain-stock", 2, True, model=_plain, masked=False)
    out["plain", "ours"] = _train(root, "plain-ours", 2, True, model=_plain, masked=False,
                                  ours=True, split=uneven, as_file=True)

    def attach(trainer, step):
        trainer.model_wrapped.attach_loop(_FlipAt(0))

    out["loop"] = _train(root, "loop", 3, True, ours=True, split=uneven,
                         act=("on_train_begin", attach))

    def flip(trainer, step):
        if step == 2:
            trainer.model_wrapped.set_split(Split(FLIPPED, GAS))

    out["callback"] = _train(root, "callback", 2, False, ours=True, split=uneven,
                             act=("on_step_end", flip))
    out["refused"] = _refused_mid_fetch(root)
    out["iterable"] = _refused_iterable(root)
    stock_ck = os.path.join(out[3, True, "stock"]["dir"], "checkpoint-2")
    ours_ck = os.path.join(out[3, True, "ours"]["dir"], "checkpoint-2")
    out["ours-from-stock"] = _train(root, "ours-from-stock", 3, True, ours=True, split=uneven,
                                    resume=stock_ck)
    out["stock-from-ours"] = _train(root, "stock-from-ours", 3, True, resume=ours_ck)
    out["ours-from-ours"] = _train(root, "ours-from-ours", 3, True, ours=True, resume=ours_ck)
    return out


def _ranks4(rank, world, root):
    from malleus_ds.dp.split import Split

    return {"stock": _train(root, "stock", 3, True, n=48, **SGD),
            "ours": _train(root, "ours", 3, True, ours=True, split=Split(UNEVEN4, GAS), n=48,
                           **SGD)}


#: the timed run: 12 steps under ZeRO-2, quick detection (a 3-step median, two in a row)
ADAPTIVE_STEPS = 12
SLOW = {"straggler": [{"rank": 1, "rate": 4.0, "start_step": 2}],
        "detect": {"window": 3, "confirm": 2, "cooldown": 2}}


def _ranks_adaptive(rank, world, root):
    n = 2 * MBS * GAS * ADAPTIVE_STEPS
    return {"stock": _train(root, "stock", 2, True, n=n, max_steps=ADAPTIVE_STEPS),
            "ours": _train(root, "ours", 2, True, ours=True, n=n, max_steps=ADAPTIVE_STEPS,
                           malleus={**SLOW, "metrics_dir": os.path.join(root, "metrics")})}


@functools.lru_cache(maxsize=1)
def _root() -> str:
    """The runs' output folders (checkpoints, metrics.jsonl), removed when pytest exits."""
    import atexit
    import shutil

    root = tempfile.mkdtemp(prefix="hf_trainer_")
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.lru_cache(maxsize=1)
def _results():
    return run_distributed(_ranks, 2, _root(), timeout=300)


@functools.lru_cache(maxsize=1)
def _results4():
    return run_distributed(_ranks4, 4, os.path.join(_root(), "w4"), timeout=300)


@functools.lru_cache(maxsize=1)
def _results_adaptive():
    return run_distributed(_ranks_adaptive, 2, os.path.join(_root(), "adaptive"), timeout=300)


def _close(got, want, what, steps=slice(None)):
    """Losses and gradient norms to rtol 1e-5; each parameter to rtol 1e-5 plus 1e-5 of its
    tensor's largest magnitude (AdamW: see :data:`SGD`)."""
    np.testing.assert_allclose(got["losses"], want["losses"][steps], rtol=1e-5,
                               err_msg=f"{what}: losses")
    np.testing.assert_allclose(got["norms"], want["norms"][steps], rtol=1e-5,
                               err_msg=f"{what}: gradient norms")
    assert got["params"].keys() == want["params"].keys()
    for k, v in want["params"].items():
        w = v.numpy()
        np.testing.assert_allclose(got["params"][k].numpy(), w, rtol=1e-5,
                                   atol=1e-5 * np.abs(w).max(), err_msg=f"{what}: {k}")


def an_uneven_split_equals_the_stock_trainer(res):
    """ZeRO-1/2/3, average_tokens_across_devices on ("global") and off ("mean")."""
    for stage in STAGES:
        for avg in (True, False):
            stock = res[0][stage, avg, "stock"]
            assert stock["engine"] == "DeepSpeedEngine" and len(stock["losses"]) == STEPS
            assert stock["losses"][-1] < stock["losses"][0]             # it trains
            assert min(stock["norms"]) > 0.5                            # and clipping bites
            for r in range(2):
                ours = res[r][stage, avg, "ours"]
                assert ours["engine"] == "MalleusDPEngine" and ours["events"] == []
                _close(res[r][stage, avg, "stock"], stock, f"stage {stage} rank {r} stock")
                _close(ours, stock, f"stage {stage} avg={avg} rank {r} split {UNEVEN}")
                # accelerate's loader collates one micro-batch ahead of the one the Trainer runs
                assert res[r][stage, avg, "stock"]["sizes"][:STEPS * GAS] == [MBS] * STEPS * GAS
                assert ours["sizes"] == [UNEVEN[r]] * STEPS * GAS


def a_model_without_loss_keywords_equals_the_stock_trainer(res):
    """The Trainer divides such a model's mean loss by the accumulation steps (no
    num_items_in_batch): the engine weights it by the rank's share ("mean"). Its ds_config is
    a JSON file's path."""
    stock = res[0]["plain", "stock"]
    for r in range(2):
        _close(res[r]["plain", "ours"], stock, f"rank {r} plain module {UNEVEN}")
        assert res[r]["plain", "ours"]["sizes"] == [UNEVEN[r]] * STEPS * GAS


def metrics_jsonl_holds_the_stock_loss_and_the_straggler_emulation(res):
    for stage in STAGES:
        for avg in (True, False):
            tag = f"z{stage}{'g' if avg else 'm'}"
            path = os.path.join(_root(), tag, "metrics", "metrics.jsonl")
            with open(path) as f:
                rows = [json.loads(x) for x in f]
            assert [r["step"] for r in rows] == list(range(STEPS)), rows
            np.testing.assert_allclose([r["loss"] for r in rows],
                                       res[0][stage, avg, "stock"]["losses"], rtol=1e-5,
                                       err_msg=tag)
            assert all(r["plan"] == "split-3-1" and r["samples"] == 8 for r in rows), rows[0]
            slowed = [r["emulated_s"][1] > 0 for r in rows]
            assert slowed == ([False, False, True, True] if tag == "z2m" else [False] * STEPS)


def an_uneven_split_in_bf16_equals_the_stock_trainer_to_bf16_rounding(res):
    """bf16 rounds each rank's partial gradients (ZeRO-1 accumulates them in bf16), so the
    uneven split's sums differ from stock's by rounding: losses and gradient norms to 2e-3,
    parameters (SGD) to two bf16 ulps of the tensor's scale (measured: up to 1.2 ulps)."""
    for stage in STAGES:
        want = res[0][stage, "stock-bf16"]
        for r in range(2):
            got = res[r][stage, "ours-bf16"]
            what = f"stage {stage} rank {r}"
            assert got["sizes"] == [UNEVEN[r]] * STEPS * GAS, what
            np.testing.assert_allclose(got["losses"], want["losses"], rtol=2e-3, err_msg=what)
            np.testing.assert_allclose(got["norms"], want["norms"], rtol=2e-3, err_msg=what)
            for k, v in want["params"].items():
                w = v.numpy()
                np.testing.assert_allclose(got["params"][k].numpy(), w, rtol=2 ** -7,
                                           atol=2 ** -7 * np.abs(w).max(), err_msg=f"{what} {k}")


def a_resplit_mid_run_keeps_equal_to_the_stock_trainer(res):
    """The loop's decision from step 0's timings, read at step 1's end; a callback's set_split at
    on_step_end after 2 steps: both run from the third step on."""
    for r in range(2):
        got = res[r]["loop"]
        assert got["events"] == [{"event": "resplit", "step": 2, "from": list(UNEVEN),
                                  "to": list(FLIPPED), "rates": [1.0, 1.0]}]
        assert got["sizes"] == [UNEVEN[r]] * 2 * GAS + [FLIPPED[r]] * 2 * GAS
        _close(got, res[0][3, True, "stock"], f"rank {r} re-split by the loop")
        got = res[r]["callback"]
        assert got["sizes"] == [UNEVEN[r]] * 2 * GAS + [FLIPPED[r]] * 2 * GAS
        _close(got, res[0][2, False, "stock"], f"rank {r} re-split from on_step_end")


def set_split_after_the_step_was_fetched_and_an_iterable_dataset_are_refused(res):
    for r in range(2):
        got = res[r]
        assert "the split changed from [3, 1] to [1, 3] after the Trainer fetched the step's " \
               "batches: set a new split at a step's end (a callback's on_step_end)" \
               in got["refused"]
        assert "train_dataset is a Stream, not a map-style dataset" in got["iterable"]


def checkpoints_resume_across_the_stock_trainer_and_ours(res):
    """ZeRO-3: each saved at step 2; the other Trainer resumes (the rest of epoch 0, then epoch
    1) and ends where the stock run ends. MalleusTrainer resuming its own checkpoint (built
    with no split: an equal one) goes on with the split saved in it."""
    stock = res[0][3, True, "stock"]
    for r in range(2):
        assert res[r]["ours-from-ours"]["sizes"] == [UNEVEN[r]] * 2 * GAS
        for key in ("ours-from-stock", "stock-from-ours", "ours-from-ours"):
            got = res[r][key]
            _close(got, stock, f"rank {r} {key}", steps=slice(2, None))
        assert res[r]["ours-from-stock"]["engine"] == "MalleusDPEngine"
        assert res[r]["ours-from-stock"]["sizes"] == [UNEVEN[r]] * 2 * GAS
        assert res[r]["stock-from-ours"]["engine"] == "DeepSpeedEngine"


#: what the 2-rank run is checked for, in order
TWO_RANK_CHECKS = (an_uneven_split_equals_the_stock_trainer,
                   a_model_without_loss_keywords_equals_the_stock_trainer,
                   metrics_jsonl_holds_the_stock_loss_and_the_straggler_emulation,
                   an_uneven_split_in_bf16_equals_the_stock_trainer_to_bf16_rounding,
                   a_resplit_mid_run_keeps_equal_to_the_stock_trainer,
                   set_split_after_the_step_was_fetched_and_an_iterable_dataset_are_refused,
                   checkpoints_resume_across_the_stock_trainer_and_ours)


def test_two_ranks_equal_the_stock_trainer():
    """Every check of :data:`TWO_RANK_CHECKS` on the one 2-rank run, each failure reported by
    the check's name. One test for the one launch: pytest-xdist (scripts/test.sh's shared pass)
    hands a file's tests to both workers, and each would pay the launch."""
    res = _results()
    failed = []
    for check in TWO_RANK_CHECKS:
        try:
            check(res)
        except AssertionError as e:
            failed.append(f"{check.__name__}: {e}")
    assert not failed, "\n\n".join(failed)


def test_four_ranks_under_zero3_with_one_rank_at_the_minimum_share():
    res = _results4()
    stock = res[0]["stock"]
    for r in range(4):
        _close(res[r]["ours"], stock, f"rank {r} split {UNEVEN4}")
        assert res[r]["ours"]["sizes"] == [UNEVEN4[r]] * STEPS * GAS


def test_a_slowed_rank_gets_fewer_samples_and_the_trainer_stays_stocks():
    """Reads timings: in tests/conftest.py's ALONE_TESTS."""
    res = _results_adaptive()
    stock = res[0]["stock"]
    for r in range(2):
        got = res[r]["ours"]
        _close(got, stock, f"rank {r} re-split by speed")
        ev = got["events"]
        assert ev == res[0]["ours"]["events"] and len(ev) >= 1, ev
        assert ev[0]["from"] == [MBS, MBS] and ev[0]["to"][1] < ev[0]["to"][0], ev
        assert ev[0]["rates"][1] > ev[0]["rates"][0] and ev[0]["step"] >= 3, ev
        first = ev[0]["step"] * GAS
        assert got["sizes"][:first] == [MBS] * first and got["sizes"][first] == ev[0]["to"][r]
    with open(os.path.join(_root(), "adaptive", "metrics", "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    steps = [x for x in rows if "event" not in x]
    assert [x["step"] for x in steps] == list(range(ADAPTIVE_STEPS))
    assert [x for x in rows if "event" in x] == res[0]["ours"]["events"]
