"""The run configuration's schema: :class:`RunConfig` and its sections, as frozen dataclasses.

Built only by :func:`malleus_ds.app.config.build_run_config` (which re-exports these names), and read
by the runners. ``ConfigError`` is here too, so every app module can raise it without importing
the parser.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..adaptive.settings import AdaptiveSettings
from ..data import DataConfig
from ..emulation.links import LinkSchedule
from ..emulation.straggler import StragglerSchedule
from ..interop.batch import DEFAULT_BATCH
from ..engine.settings import MalleusSettings, SwitchAt
from ..models.llama import ModelConfig
from ..optim import OptimConfig


class ConfigError(ValueError):
    """A run configuration is invalid. The message names the field and the numbers."""


#: Engines the app knows (the runner registry in ``malleus_ds.app.runners`` maps them to code).
ENGINES = ("torch", "deepspeed", "malleus")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10                     # optimizer steps to run
    global_batch_size: int = DEFAULT_BATCH[0]   # samples per optimizer step (all ranks together)
    micro_batch_size: int = DEFAULT_BATCH[1]    # samples per forward/backward
    seed: int = 0                       # model init seed (per global layer index)
    data_seed: int | None = None        # corpus order seed; None = ``seed``
    lr: float = 1e-3                    # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.95)   # AdamW's betas
    eps: float = 1e-8                   # AdamW's eps
    weight_decay: float = 0.0           # AdamW's decoupled weight decay
    warmup_steps: int = 1               # steps left out of throughput summaries (not of training)
    #: recompute each decoder layer's activations in backward (resolved against the ds_config by
    #: config_deepspeed.resolve_activation_checkpointing: True/False here, never None)
    activation_checkpointing: bool = False

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, betas=self.betas, eps=self.eps,
                           weight_decay=self.weight_decay)

    @property
    def corpus_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed


@dataclass(frozen=True)
class ParallelConfig:
    """Nominal layout degrees; ``tp * pp * dp == world_size`` (DESIGN.md §2 static plan)."""

    tp: int = 1                         # tensor-parallel degree
    pp: int = 1                         # pipeline stages
    dp: int = 1                         # data-parallel replicas (config null: world/(tp*pp))
    #: the ``parallel.pp`` asked for when an elastic restart's world size could not be tiled by
    #: it and engine=malleus took ``pp`` stages instead (``config_sections.elastic_pp``); None
    #: otherwise
    asked_pp: int | None = None


@dataclass(frozen=True)
class ClusterConfig:
    gpus_per_node: int = 1              # ranks per node; TP groups never cross a node
    nodes: int = 1                      # nodes of the job


@dataclass(frozen=True)
class DeepSpeedSection:
    """The ds_config a run uses: a preset under ``conf/deepspeed/`` or the user's own JSON."""

    config_file: str | None = None      # absolute path of the JSON it was read from
    #: the ds_config itself, as read and with its "auto" values filled
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: one line per value the app filled or key it left to MalleusEngine's own way (interop/auto.py)
    notes: tuple[str, ...] = field(default=(), hash=False)

    @property
    def zero_stage(self) -> int:
        return int((self.config.get("zero_optimization") or {}).get("stage", 0))


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint.*``: where and how often the app saves, and whether it resumes."""

    dir: str | None = None              # absolute folder (resolved against the CWD); None = none
    every: int = 0                      # save every N optimizer steps; 0 = only at the end
    resume: bool | str = False          # True: continue from ``dir/latest`` (an error if none);
                                        # "auto": continue if there is one, else start fresh
    background: bool = True             # engine=malleus: write while training goes on
    keep: int = 0                       # the newest N committed checkpoints stay; 0 = all

    @property
    def enabled(self) -> bool:
        return self.dir is not None


@dataclass(frozen=True)
class MalleusConfig:
    """``malleus.*`` (engine=malleus), parsed once by ``config_sections.parse_malleus``: the
    scripted switches with their plans read, the migration limits, and the adaptive loop's
    settings (``loop``: its keys are the loop's, at the top of ``malleus.*``;
    ``interop/malleus_section.py``).
    Defaults are the engine's and the loop's own (``MalleusSettings``, ``AdaptiveSettings``);
    conf/config.yaml repeats them for ``--help`` and overrides, and a test holds the two equal."""

    switch: tuple[SwitchAt, ...] = ()   # scripted live plan switches, by step
    #: packed migration bytes in flight per rank (MB)
    migrate_bucket_mb: float = MalleusSettings.migrate_bucket_mb
    #: a migration transfer not finished by then stops the job (s)
    migrate_timeout_s: float = MalleusSettings.migrate_timeout_s
    #: the adaptive loop's keys (``malleus.adaptive``, ``malleus.detect``, ...)
    loop: AdaptiveSettings = field(default_factory=AdaptiveSettings)


@dataclass(frozen=True)
class RunConfig:
    engine: str                     # torch | deepspeed | malleus (ENGINES)
    model: ModelConfig              # or models.hf.HFModel (model=hf): the interface of models/base.py
    train: TrainConfig              # steps, batch sizes, seeds, the optimizer's settings
    parallel: ParallelConfig        # the nominal layout degrees
    cluster: ClusterConfig          # the job's node shape
    straggler: StragglerSchedule    # straggler.schedule and straggler.method: emulated stragglers
    deepspeed: DeepSpeedSection     # deepspeed.*: the ds_config
    world_size: int = 1                 # ranks launched (from the launcher, not a setting)
    plan: str = "static"                # "static" or a path to a plan JSON (engine=malleus)
    run_dir: str | None = None          # rank 0 writes metrics.jsonl here; None = no files
    device: str = "auto"                # auto | cpu | cuda
    progress: bool = True               # tqdm bar on rank 0
    malleus: MalleusConfig = field(default_factory=MalleusConfig, hash=False)  # engine=malleus
    checkpoint: CheckpointConfig = CheckpointConfig()
    data: DataConfig = DataConfig()     # what the run trains on (data=bytes | data=tokens)
    comm_timeout_s: float = 1800.0      # process-group timeout: a collective waiting longer fails
    hang_timeout_s: float = 300.0       # no progress on some rank this long stops the job; 0 = off
    log_every: int = 10                 # progress line every N steps when stdout is no terminal
    #: ``straggler.link_schedule``: emulated slow links (emulation/links.py)
    links: LinkSchedule = field(default_factory=LinkSchedule, hash=False)
    #: the emulation's entries an elastic restart on fewer ranks left out, one line each
    #: (``config._on_this_world``), said at start-up
    emulation_notes: tuple[str, ...] = field(default=(), hash=False)
