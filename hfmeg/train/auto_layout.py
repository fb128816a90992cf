"""`parallel.layout: auto`: the planner picks the run's layout before the model is built.

Rank 0 asks the planner for the fastest layout that fits the hardware it detects
(`plan.auto.detect_cluster`, `plan.search.best_layout`) and broadcasts the answer, so
every rank builds the same layout even though the CPU timings behind it vary from run
to run (an error is broadcast too, so every rank stops with the same line). The choice
sets the fields in `AUTO_FIELDS` on a new config (`dataclasses.replace`: the parsed
config is never edited); the config's own values for them, e.g. a recipe YAML's
layout, are replaced, and a command line that sets one of them is refused
(`validate.py`). For an MoE model the choice includes EP (the planner tries every
divisor of DP that divides the expert count). Rank 0 prints the choice and the
planner's prediction in one line.

A resumed run keeps the layout its checkpoint was trained with: the shards are cut for
it, and a fresh choice could differ (other timings, another planner version). The
planner then only predicts.

`LayoutReport` holds the prediction against the run: after one warm-up step and
`REPORT_STEPS` timed ones (or at the run's last step, if sooner) rank 0 prints
`plan.auto.report`, the median step time measured against the predicted one and, on
CUDA, the peak memory (`max_memory_allocated`, the maximum over ranks: the planner
predicts the busiest rank).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import load_hf_config
from ..families import model_config_from_hf
from ..errors import LayoutError
from ..parallel.state import ranks_per_host
from ..plan.auto import choice_line, detect_cluster, report
from ..plan.layout import PlanLayout
from ..plan.search import Evaluation, Job, best_layout, evaluate
from .checkpointing import find_resume, read_trainer_state
from .config import AUTO_FIELDS, TrainConfig
from .dataclass_io import build

REPORT_STEPS = 5


def apply_layout(cfg: TrainConfig, lay: PlanLayout) -> TrainConfig:
    """`cfg` with `lay`'s values in the AUTO_FIELDS, as a new config."""
    values = (lay.tp, lay.pp, lay.vpp, lay.sp, lay.schedule, lay.micro_batch, lay.recompute, lay.ep, lay.cp)
    sections: dict[str, dict] = {}
    for key, value in zip(AUTO_FIELDS, values):
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return replace(cfg, **{s: replace(getattr(cfg, s), **fields) for s, fields in sections.items()})


def layout_of(cfg: TrainConfig, world_size: int) -> PlanLayout:
    """The planner's name for the layout `cfg` runs on `world_size` ranks."""
    p = cfg.parallel
    return PlanLayout(p.tp, p.pp, p.grid(world_size).dp, cfg.train.micro_batch_size, p.vpp,
                      cfg.model.recompute, p.sequence_parallel, cfg.optim.mode, p.run_schedule, p.ep, p.cp,
                      cfg.model.vocab_multiple)


def _plan(cfg: TrainConfig, device: torch.device) -> tuple[PlanLayout, Evaluation | None, str]:
    """Rank 0: (the layout, the planner's evaluation of it or None, the line to print)."""
    world = dist.get_world_size()
    cluster, profile = detect_cluster(world, ranks_per_host() or world, device,
                                      cfg.parallel.plan_profile)
    model = model_config_from_hf(load_hf_config(cfg.model.hf_folder()))
    job = Job(model, cluster, profile, cfg.train.global_batch_size, cfg.data.seq_len,
              cfg.model.torch_dtype(device).itemsize, peft=cfg.peft if cfg.peft.enabled else None,
              cross_host=cfg.parallel.allow_cross_host,  # only layouts ParallelState will accept
              vocab_multiple=cfg.model.vocab_multiple,
              fp8=cfg.model.fp8 != "off",
              **(cfg.grpo.planner_terms(cfg.peft.enabled, cfg.train.global_batch_size, cfg.data.seq_len)
                 if cfg.grpo.enabled else cfg.preference.planner_terms(adapters=cfg.peft.enabled)))
    ck = cfg.checkpoint
    resume = find_resume(Path(ck.out) / "checkpoints", ck.resume, overwrite=ck.overwrite).folder
    if resume is None:
        ev = best_layout(job, cfg.optim.mode)
        return ev.layout, ev, choice_line(ev, cluster, "the fastest that fits")
    saved = build(type(cfg), read_trainer_state(resume)["config"])
    lay = replace(layout_of(saved, world), optimizer=cfg.optim.mode)
    why = f"kept from {resume}, whose shards are cut for it"
    try:
        ev = evaluate(job, lay)
    except LayoutError as e:
        return lay, None, f"layout auto: {lay.name()} ({why}); no prediction: {e}"
    return lay, ev, choice_line(ev, cluster, why)


def resolve_layout(cfg: TrainConfig, device: torch.device) -> tuple[TrainConfig, Evaluation | None]:
    """Every rank: the config the run uses, and the planner's evaluation of its layout (None: nothing to report)."""
    if cfg.parallel.layout != "auto":
        return cfg, None
    answer: list = [None]
    if dist.get_rank() == 0:
        try:
            answer = [_plan(cfg, device)]
        except Exception as e:  # noqa: BLE001 - broadcast, so that no rank waits for a choice that never comes
            answer = [e]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], Exception):
        raise answer[0]
    lay, ev, line = answer[0]
    if dist.get_rank() == 0:
        print(line, flush=True)
    return apply_layout(cfg, lay), ev


def _peak_memory(device: torch.device) -> int | None:
    """The largest `max_memory_allocated` of any rank; None off CUDA (a CPU has no such counter)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device)], dtype=torch.int64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


class LayoutReport:
    """The prediction against this run's first steps; every rank calls `after_step` (the memory is a collective)."""

    def __init__(self, ev: Evaluation, first_step: int, max_steps: int, device: torch.device):
        self.ev, self.device = ev, device
        self.at = min(first_step + 1 + REPORT_STEPS, max_steps)
        self.times: list[float] = []

    def after_step(self, step: int, seconds: float) -> str | None:
        """The report line at step `self.at`, else None."""
        self.times.append(seconds)
        if step != self.at:
            return None
        timed = self.times[1:] or self.times  # the first step warms up: allocator, kernel choices, data prefetch
        return report(self.ev, statistics.median(timed), _peak_memory(self.device))
