"""Where a run resumes: the app's ``run.json`` record of a checkpoint and the checks that a
run may continue from it (``checkpoint.resume=true|auto``); the folder layout and saving are in
:mod:`.checkpoint`.

``run.json`` holds the training position and what a resume must match::

    {"format": RUN_FORMAT, "engine": "malleus", "step": 3, "world_size": 4,
     "global_batch_size": 8, "micro_batch_size": 1, "data_seed": 0, "model": {...},
     "parallel": {"tp": 1, "pp": 1, "dp": 4}, "zero_stage": 1, "precision": "fp32",
     "data": {"kind": "tokens", "path": "/abs/train.bin", "dtype": "uint16",
              "tokens": 1000000, "seq_len": 64}}

The position is ``step`` alone: the global batch of step ``k`` is a pure function of ``k``, the
global batch size, the data seed and the data (``data.*``: kind, file, its length, seq_len;
``reference.micro_batches``), so a run resumed at step N with the same ones sees the same
samples as one that never stopped. A record without ``data`` (saved before ``data.*`` existed)
was trained on the byte corpus at the model's ``max_seq_len``. Weights, optimizer state,
LR schedule and (engine=malleus) loss scaler come from the engine's files.

Resume checks (:func:`resume_point`) read only shared files and run before any process group,
so every rank fails with the same :class:`ConfigError`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...files.ckpt_format import LATEST, RUN_FILE, RUN_FORMAT
from ..run_config import ConfigError, RunConfig

#: what every engine needs unchanged on resume (the data position and the model's tensors)
COMMON = ("engine", "model", "global_batch_size", "micro_batch_size", "data_seed", "data")
#: what an engine's own format needs on top: stock DeepSpeed loads only under the saving layout
STRICT = {"deepspeed": ("world_size", "parallel", "zero_stage", "precision")}
#: the config field each record key comes from (for messages)
FIELD = {"global_batch_size": "train.global_batch_size", "micro_batch_size":
         "train.micro_batch_size", "data_seed": "train.data_seed", "world_size": "world_size",
         "parallel": "parallel", "zero_stage": "ds_config zero_optimization.stage",
         "precision": "ds_config precision (bf16/fp16)", "engine": "engine", "data": "data"}


def _fmt(v: Any) -> str:
    if isinstance(v, dict):         # parallel: tp=1 pp=1 dp=2
        return " ".join(f"{k}={x}" for k, x in v.items())
    return str(v)


def tag_of(step: int) -> str:
    return f"global_step{step}"


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint: ``root/tag`` with its ``run.json``."""

    root: Path
    tag: str
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def path(self) -> Path:
        return self.root / self.tag


def _batch(cfg: RunConfig) -> tuple[int, int]:
    """The global and micro batch the run really uses (engine=malleus: its plan's)."""
    if cfg.engine == "malleus":
        from .job import load_plan

        p = load_plan(cfg)
        return p.global_batch_size, p.micro_batch_size
    return cfg.train.global_batch_size, cfg.train.micro_batch_size


def _precision(cfg: RunConfig) -> str:
    if cfg.engine == "torch":
        return "fp32"
    from ...engine.precision import Precision

    return Precision.name_of(cfg.deepspeed.config)


def data_record(cfg: RunConfig) -> dict:
    """What the run trains on, as ``run.json`` records it: the kind, the token file (absolute
    path, dtype, length in tokens) and the tokens per sample; ``data=text`` adds the tokenizer
    folder and the content key of text and tokenizer (``text_key``: changed text or a changed
    tokenizer is other data, even under the same names)."""
    d = cfg.data
    rec = {"kind": d.kind, "path": None, "dtype": None, "tokens": None,
           "seq_len": d.resolved_seq_len(cfg.model)}
    if d.kind == "tokens":
        from ...data.tokens import inspect_token_file

        tf = inspect_token_file(d.path, d.dtype)    # header and size only
        rec.update(path=str(tf.path), dtype=tf.dtype.name, tokens=tf.num_tokens)
    elif d.kind == "text":
        from ...data.tokens import inspect_token_file

        tf = inspect_token_file(d.token_file)       # the cache file: named by the content key
        rec.update(path=d.path, dtype=tf.dtype.name, tokens=tf.num_tokens,
                   tokenizer=d.tokenizer, text_key=tf.path.stem)
    return rec


def _legacy_data_record(meta: dict) -> dict:
    """The data of a record saved before ``data.*`` existed: the byte corpus at max_seq_len."""
    return {"kind": "bytes", "path": None, "dtype": None, "tokens": None,
            "seq_len": (meta.get("model") or {}).get("max_seq_len")}


def _fmt_data(rec: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in rec.items() if v is not None)


def run_record(cfg: RunConfig, step: int) -> dict:
    """``run.json`` for a checkpoint of ``cfg`` after ``step`` steps (JSON-normalised)."""
    g, mbs = _batch(cfg)
    p = cfg.parallel
    rec = {"format": RUN_FORMAT, "engine": cfg.engine, "step": step, "world_size": cfg.world_size,
           "global_batch_size": g, "micro_batch_size": mbs, "data_seed": cfg.train.corpus_seed,
           "model": cfg.model.describe(), "parallel": {"tp": p.tp, "pp": p.pp, "dp": p.dp},
           "zero_stage": 0 if cfg.engine == "torch" else cfg.deepspeed.zero_stage,
           "precision": _precision(cfg), "data": data_record(cfg)}
    return json.loads(json.dumps(rec))


def read_saved(root: Path) -> Saved | None:
    """The checkpoint ``root/latest`` names; None when there is no ``latest``. ConfigError when
    ``latest`` names something that is not a complete app checkpoint."""
    latest = root / LATEST
    if not latest.is_file():
        return None
    from ...files.safe_load import UnsafeFile, read_json, read_small_text

    try:
        tag = read_small_text(latest, "'latest' file").strip()
    except UnsafeFile as e:
        raise ConfigError(f"checkpoint.dir={root}: {e}") from None
    rf = root / tag / RUN_FILE
    if tag and not rf.is_file():
        foreign = _deepspeed_folder(root, tag)
        if foreign is not None:
            return foreign
    if not tag or not rf.is_file():
        raise ConfigError(f"checkpoint.dir={root}: '{LATEST}' names {tag!r} but {rf} does not "
                          f"exist: an unfinished save, or a checkpoint not written by "
                          f"launch/train.py")
    try:
        meta = read_json(rf, "checkpoint run record")
    except UnsafeFile as e:
        raise ConfigError(f"checkpoint: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != RUN_FORMAT or "step" not in meta:
        raise ConfigError(f"checkpoint {rf}: not a {RUN_FORMAT} record")
    return Saved(root, tag, meta)


def _deepspeed_folder(root: Path, tag: str) -> Saved | None:
    """A DeepSpeed checkpoint that a user's own script saved (``engine.save_checkpoint``: a tag
    folder and ``latest``, no ``run.json``) as a record engine=malleus continues: its step from
    the tag DeepSpeed names by default (``global_step{N}``), else from the folder's
    ``global_steps``; ``foreign``: nothing else is recorded to check."""
    import re

    from ...interop.checkpoint import is_deepspeed_checkpoint

    if not is_deepspeed_checkpoint(root / tag):
        return None
    m = re.fullmatch(r"global_step(\d+)", tag)
    if m is not None:
        step = int(m.group(1))
    else:
        from ...interop.checkpoint import read_steps
        from ...files.ckpt_format import CheckpointError

        try:
            step = read_steps(root / tag)
        except CheckpointError as e:
            raise ConfigError(f"checkpoint.dir={root}: {e}") from None
    return Saved(root, tag, {"format": RUN_FORMAT, "engine": "deepspeed", "step": step,
                             "foreign": True})


def resume_point(cfg: RunConfig) -> Saved | None:
    """The checkpoint a ``checkpoint.resume=true|auto`` run starts from, checked against the run;
    None when not resuming (``auto``: when ``dir`` holds no checkpoint yet). Pure apart from
    reading files (no process group needed), so every rank decides the same."""
    if not cfg.checkpoint.resume:
        return None
    root = Path(cfg.checkpoint.dir)
    saved = read_saved(root)
    if saved is None and cfg.checkpoint.resume == "auto":
        return None
    if saved is None:
        # resume=true promises to continue at the saved step: starting from scratch instead
        # would silently retrain (and overwrite) what the user meant to continue
        where = "has no 'latest' file" if root.is_dir() else "does not exist"
        raise ConfigError(f"checkpoint.resume=true but checkpoint.dir={root} {where}: there is "
                          f"no checkpoint to continue from; run once with checkpoint.resume="
                          f"false to start from scratch, or point checkpoint.dir at the folder "
                          f"a run saved to")
    if saved.meta.get("foreign"):
        if cfg.engine != "malleus":
            raise ConfigError(f"checkpoint {saved.path} is a DeepSpeed checkpoint your own script "
                              f"saved (no run.json): engine=malleus continues it under any "
                              f"plan; with engine={cfg.engine}, continue it in that script")
        return saved
    _check_record(cfg, saved)
    return saved


def _check_record(cfg: RunConfig, saved: Saved) -> None:
    """The saved record against this run's, key by key (:data:`COMMON`, and :data:`STRICT` for
    the engine); a ConfigError names the first key that differs and how to resume."""
    now = run_record(cfg, saved.step)
    for k in COMMON + STRICT.get(cfg.engine, ()):
        was, is_ = saved.meta.get(k), now[k]
        if k == "data" and was is None:
            was = _legacy_data_record(saved.meta)
        if was == is_:
            continue
        err = _mismatch(cfg, saved, k, was, is_)
        if err is not None:
            raise err


def _mismatch(cfg: RunConfig, saved: Saved, k: str, was: Any, is_: Any) -> ConfigError | None:
    """The error for record key ``k`` saved as ``was`` against this run's ``is_``; None where
    the run continues anyway (engine=malleus reads stock DeepSpeed's files; a universal
    checkpoint loads under any DeepSpeed layout)."""
    if k == "engine":
        if (was, is_) == ("deepspeed", "malleus"):
            return None             # MalleusEngine reads stock DeepSpeed's files
        return ConfigError(f"checkpoint {saved.path} was saved by engine={was}, this run has "
                           f"engine={is_}; resume with engine={was}"
                           + (" (engine=malleus continues engine=deepspeed checkpoints, not "
                              "the other way)" if is_ == "deepspeed" else ""))
    if k == "model":
        diff = [f"model.{f}={(was or {}).get(f)!r} there, {v!r} here"
                for f, v in is_.items() if (was or {}).get(f) != v]
        return ConfigError(f"checkpoint {saved.path} holds another model: {'; '.join(diff)}")
    if k == "data":
        was = was if isinstance(was, dict) else {}
        diff = [f"{f}={was.get(f)!r} there, {v!r} here" for f, v in is_.items()
                if was.get(f) != v]
        return ConfigError(f"checkpoint {saved.path} was trained on other data "
                           f"({_fmt_data(was)}), this run has {_fmt_data(is_)}: "
                           f"{'; '.join(diff)}; the data position of step {saved.step} belongs "
                           f"to the saved data: resume with the same data=, data.path (the file "
                           f"unchanged) and data.seq_len")
    if k in STRICT.get(cfg.engine, ()) and saved.meta.get("universal"):
        return None                 # a universal checkpoint loads under any DeepSpeed layout
    if k in STRICT.get(cfg.engine, ()):
        m = saved.meta
        return ConfigError(
            f"checkpoint {saved.path} was saved by engine={cfg.engine} with {FIELD[k]} "
            f"{_fmt(was)}, this run has {_fmt(is_)}: stock DeepSpeed checkpoints load only "
            f"under the layout that saved them ({m.get('world_size')} ranks, "
            f"{_fmt(m.get('parallel'))}, ZeRO stage {m.get('zero_stage')}, "
            f"{m.get('precision')}); resume with that layout, or use engine=malleus, whose "
            f"checkpoints load under any plan and world size")
    return ConfigError(f"checkpoint {saved.path} has {FIELD[k]}={was}, this run {is_}: the "
                       f"data position of step {saved.step} and the optimizer state belong to "
                       f"{FIELD[k]}={was}; resume with it")


def latest_note(ckpt_dir: str | None) -> str:
    """Where a failed job continues from: the checkpoint ``ckpt_dir/latest`` names, as a
    sentence (no checkpoint yet, or none configured, is said so)."""
    if not ckpt_dir:
        return "No checkpoint.dir was set: a new run starts from step 0"
    root = Path(ckpt_dir).absolute()
    try:
        saved = read_saved(root)
    except ConfigError as e:
        return f"The checkpoint folder is not usable: {e}"
    if saved is None:
        return f"No checkpoint was saved in {root} yet: a new run starts from step 0"
    return (f"Resume from {saved.path} (step {saved.step}) with checkpoint.dir={root} "
            f"checkpoint.resume=auto")


def start_line(cfg: RunConfig, saved: Saved | None) -> str | None:
    """The start-up line that says where a resuming run starts (None when not resuming)."""
    c = cfg.checkpoint
    mode = "auto" if c.resume == "auto" else "true"
    if not c.resume:
        return None
    if saved is None:
        return (f"[malleus_ds] checkpoint.resume={mode}: starting fresh at step 0 "
                f"(checkpoint.dir={c.dir} holds no checkpoint yet)")
    return f"[malleus_ds] checkpoint.resume={mode}: continuing from step {saved.step} ({saved.path})"


def carried_rates(meta: dict, devices: list[str]) -> list[float | None] | None:
    """The measured rates a checkpoint's ``run.json`` carries (``rates`` and ``devices``: one
    per saving rank), for the ranks of this job, named by ``devices`` (``host/local_rank``).

    A device keeps its rate wherever the restart placed it. When device names are not unique
    (two emulated nodes on one host) they cannot be told apart: by rank if the world size is the
    saving one, else nothing is carried. None when the record has no rates."""
    rates, saved = meta.get("rates"), meta.get("devices")
    if not isinstance(rates, list) or not rates:
        return None
    rates = [float(x) if isinstance(x, (int, float)) and x == x else None for x in rates]
    if (isinstance(saved, list) and len(saved) == len(rates) and len(set(saved)) == len(saved)
            and len(set(devices)) == len(devices)):
        by_device = dict(zip(saved, rates))
        return [by_device.get(d) for d in devices]
    return rates if len(rates) == len(devices) else None


def nothing_to_run(cfg: RunConfig, saved: Saved):
    """The summary of a resumed run whose checkpoint already reached ``train.steps``."""
    from .base import RunSummary

    return RunSummary(engine=cfg.engine, losses=(), step_times_s=(),
                      samples_per_step=int(saved.meta["global_batch_size"]),
                      extra={"resumed_from": {"step": saved.step, "path": str(saved.path)},
                             "nothing_to_run": True})
