"""`TrainConfig`: every setting of a run, typed, in one tree.

Filled from a YAML file plus command-line overrides and checked as a whole before
any work (`validate.load_config`), saved as `<out>/config.yaml` at start and in the
trainer state of every checkpoint. The optimizer, LR and data sections are
those packages' own configs, and the parallel section is a `ParallelConfig` (with
the schedule and layer split added), so there is one source of truth. Defaults that
depend on other fields are derived here, once, from the typed config: the schedule
a run uses (`ParallelArgs.run_schedule`), `lr.total_steps` (`train.max_steps`) and
`optim.compression_start_step` (10 % of `train.max_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ..checkpoint.hub_source import resolve_hf_source
from ..config import VOCAB_MULTIPLE
from ..checkpoint.mp_layout import parse_dtype
from ..data.config import DataConfig
from ..optim.config import OptimizerConfig
from ..optim.lr_schedule import LRScheduleConfig
from ..parallel.linear_cross_entropy import CE_CHUNK_TOKENS
from ..parallel.state import ParallelConfig
from ..peft.config import PeftConfig
from .dataclass_io import build, convert, to_dict
from .grpo import GRPOSettings
from .preference import PreferenceConfig
from .trackers import Tracker


# `model.fp8`: torchao's FP8 training recipes by their names (quant/fp8_training.py), or off
FP8Recipe = Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"]


@dataclass
class ModelArgs:
    path: str = ""  # HF folder, Hub id, or an hfmeg shard folder (convert_hf_to_mp.py output)
    # random: pretraining from scratch, transformers' own initialisation (seeded by train.seed) of the
    # architecture in config_from's config.json, whose tokenizer the run uses; path stays empty.
    init: Literal["pretrained", "random"] = "pretrained"
    config_from: str = ""  # HF folder or Hub id (model.init random only)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPUs, fp32 on CPU
    recompute: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each dense decoder layer's forward as one graph, MoE layers' norm/RoPE/SwiGLU (GPU)
    vocab_multiple: int = VOCAB_MULTIPLE
    ce_chunk_tokens: int = CE_CHUNK_TOKENS
    # FP8 compute of the TP/SP/EP linears with torchao's recipe of this name (docs/fp8.md); checkpoints stay in
    # `dtype`. Emulated (fp32 products of the FP8 values) where the device has no FP8 GEMM.
    fp8: FP8Recipe = "off"
    fp8_exclude: list[str] = field(default_factory=list)  # module-name patterns kept out of FP8 (beside `*.router`)

    @property
    def source(self) -> str:
        """Where the run's config.json and tokenizer come from."""
        return self.config_from if self.init == "random" else self.path

    def hf_folder(self) -> Path:
        """`source` as a local folder, fetched from the Hub if it is an id (weights only if the run reads them)."""
        return resolve_hf_source(self.source, weights=self.init == "pretrained")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the run computes in on `device`: `auto` is bf16 on GPUs, fp32 on CPU."""
        return parse_dtype(self.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)


@dataclass(frozen=True)
class ParallelArgs(ParallelConfig):
    """The run's layout (tp, pp, vpp, sequence_parallel) plus how the pipeline runs it.

    `layout: auto` lets the planner choose tp, pp, vpp, sequence_parallel, schedule,
    train.micro_batch_size and model.recompute at start (`auto_layout.py`); `manual`
    runs the values given here."""

    layout: Literal["manual", "auto"] = "manual"
    # `layout: auto` times its choice with this `hfmeg plan calibrate` profile (CPU: one calibrated with the
    # ranks on the host, which the quick measurement at start cannot do; GPU: a measured one instead of the
    # kind's assumed one); None: measured at start on CPU ranks, assumed on GPUs
    plan_profile: str | None = None
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"  # vpp > 1 implies interleaved
    pp_layers: list[int] | None = None  # layers per pipeline chunk; default even

    @property
    def run_schedule(self) -> str:
        """The schedule the run uses: virtual chunks (vpp > 1) can only run interleaved."""
        return "interleaved" if self.vpp > 1 else self.schedule


@dataclass
class LoopArgs:
    micro_batch_size: int = 1
    global_batch_size: int = 8  # sequences per optimizer step, over all DP ranks
    max_steps: int = 100
    # Stop once this many epochs of training data are drawn (data.epoch), or at max_steps: the first reached.
    # The LR schedule spans max_steps (lr.total_steps): set it to the epochs' steps for a schedule that ends with them.
    num_epochs: float | None = None
    eval_every: int = 0  # 0: no evaluation
    eval_batches: int = 4
    seed: int = 1234
    max_skipped_steps: int = 10  # this many skipped (non-finite) steps in a row: save and abort; 0: never
    # How long a collective waits for its peers (init_process_group's timeout; torch's own default is longer).
    collective_timeout_s: float = 600.0
    # A rank silent this long is lost: every other rank names it and exits (parallel/heartbeat.py); 0: off.
    heartbeat_timeout_s: float = 60.0
    # Steps before this one run with every layer sharing layer 0's parameters (models/shared_layers.py); 0: never.
    shared_layers_until: int = 0


# What `parallel.layout: auto` sets (train/auto_layout.py), in the order it reads them off the
# planner's layout; validation refuses any of them set by hand beside it.
AUTO_FIELDS = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.sequence_parallel", "parallel.schedule",
               "train.micro_batch_size", "model.recompute", "parallel.ep", "parallel.cp")


@dataclass
class CheckpointArgs:
    out: str = "out/run"
    save_every: int = 0  # 0: only at the end (and on SIGTERM/SIGINT)
    keep_last: int = 2
    resume: str = "none"  # none | auto | path to a checkpoint iteration folder
    overwrite: bool = False  # with resume none: start a new timeline in an out that holds checkpoints


@dataclass
class HubArgs:
    push_to_hub: str | None = None  # repo id
    private: bool = False


@dataclass
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr: LRScheduleConfig = field(default_factory=LRScheduleConfig)  # total_steps defaults to train.max_steps
    data: DataConfig = field(default_factory=DataConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # method none: full fine-tuning
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)  # loss_type none: next-token loss
    grpo: GRPOSettings = field(default_factory=GRPOSettings)  # online RL when it names reward functions
    train: LoopArgs = field(default_factory=LoopArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    hub: HubArgs = field(default_factory=HubArgs)
    # where metrics and the config go besides metrics.jsonl (trackers.py); [] or `none`: nowhere else
    report_to: list[Tracker] = field(default_factory=lambda: ["tensorboard"])

    def __post_init__(self) -> None:
        # A bad max_steps is left to `validate`, which names train.max_steps rather than the derived fields.
        steps = self.train.max_steps
        if not (isinstance(steps, int) and steps >= 1):
            return
        if self.lr.total_steps is None:
            self.lr = replace(self.lr, total_steps=steps)
        if self.optim.compression_start_step is None:
            self.optim = replace(self.optim, compression_start_step=steps // 10)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def train_config(data: dict[str, Any]) -> TrainConfig:
    """`TrainConfig` from plain data (a YAML file with its overrides, a checkpoint's saved config), with the fields an
    earlier release wrote turned into what replaced them, so that its runs still resume and export: `tensorboard:
    true|false` (before the trackers) is `report_to: [tensorboard]` or `[]`."""
    if "tensorboard" in data and "report_to" not in data:
        data = dict(data)
        data["report_to"] = ["tensorboard"] if convert(data.pop("tensorboard"), bool, "tensorboard") else []
    return build(TrainConfig, data)
