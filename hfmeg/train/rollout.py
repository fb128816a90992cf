"""The data of a GRPO run: each step's completions, generated from the current weights, scored and packed.

`Rollouts` stands where an SFT run's data pipeline stands (the trainer asks it for the next batch, its
state and its report). For a step it:
1. pushes the trained weights to the engine: every rank hands rank 0 its shard in memory (what it would write
   into a checkpoint, `checkpoint/live_shards.py`; a LoRA run its adapters, merged into the base as its export
   merges them); rank 0 exports them to an HF folder in shared memory (the streaming HF exporter, into /dev/shm
   where there is one) for the engine to load (a vLLM worker's `reload_weights`, or the in-process transformers
   model's build), or, once the in-process model is built, copies the changed HF tensors into it in place
   (`ModelPart.live_weights`, no file; where the engine's model cannot take its stored tensors by name, a
   model whose weights transformers converts as it loads them, every push is a folder it builds from);
2. on rank 0: takes a generation batch's prompts (`data/prompts.py`: `global_batch_size / num_generations` of
   them, times the optimizer steps one generation feeds, `steps_per_generation`), samples each
   `num_generations` times with a seed per (train.seed, epoch, record, sample), scores them (`rewards.py`)
   and turns the rewards into advantages with each group whole (`grpo.group_advantages`), then sends the
   completions and advantages to every rank (one broadcast); what fails there (a reward function that
   raises or returns the wrong count, a bad prompt) stops every rank with rank 0's one line, the last
   checkpoint as it was;
3. the generation batch is cut into its steps' global batches, in order (TRL shuffles its buffered
   generation batch first; in order every step's groups are whole), and each DP rank packs its contiguous
   share of each, one completion per row, `micro_batch_size` rows per micro-batch, cut for its CP rank; where
   the batch serves more than one optimizer step (`steps_per_generation` or `num_iterations` > 1) the
   policy's forward-only pass fills π_old (`old_logps`) of every step's batch now, before any of them
   trains, and the steps take them in turn, `num_iterations` times over (TRL's order). A checkpoint taken
   between those steps keeps the batch and π_old (`rollout_checkpoint.py`), and a resume takes the remaining steps
   from it, as the uninterrupted run does.
Rank 0 appends the step's first group, with its rewards, to `<out>/completions.jsonl`.

An evaluation (`train.eval_every`, `evaluate`) pushes the weights the same way, and rank 0 generates one greedy
completion (temperature 0) of each held-out prompt (`data.eval_split`, or `data.eval_sources`:
`data/prompts.py` `eval_prompts`), in batches of `global_batch_size`, and scores them: TRL's reward metrics of
those completions, which the loop logs as `eval_reward`, `eval_rewards/<func>/mean`, ... (`eval/reward` in the
trackers).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checkpoint.mp_save import chunks_layout
from ..data import DataReport
from ..data.batches import check_batch_layout
from ..data.prompts import PromptReader, eval_prompts
from ..data.rollouts import CompletionBatch, pack_completions
from ..parallel.agree import agree
from ..errors import CheckpointError, HfmegError
from ..generation.engine import Engine, SamplingParams
from ..generation.transformers_engine import TransformersEngine
from ..generation.vllm_engine import VLLMEngine
from . import rollout_checkpoint
from .checkpointing import ROLLOUT_DIR
from .grpo import annotate_logps, group_advantages, reward_metrics, weighted_total
from .rollout_checkpoint import Generation
from .rollout_folder import PREFIX, RolloutFolder
from .rewards import name_of, resolve, score, text_of

COMPLETIONS_FILE = "completions.jsonl"
WEIGHTS_DIR = "rollout_weights"
VLLM_LOG = "vllm.log"
SHM = Path("/dev/shm")


@dataclass
class RolloutBatch:
    """A step's share of completions for this rank, and the global counts and generation metrics."""

    microbatches: list[CompletionBatch]
    num_tokens: int  # completion tokens that count, whole global batch
    num_completions: int  # whole global batch
    metrics: dict[str, float] = field(default_factory=dict)
    dapo_tokens: float | None = None  # DAPO's normaliser: the generation batch's tokens / its steps (grpo.py)


def completion_metrics(completions) -> dict[str, float]:
    """TRL's `completions/mean_length` and `completions/clipped_ratio` (ran to max_completion_length)."""
    lengths = torch.tensor([len(c.completion_ids) for c in completions], dtype=torch.float64)
    return {"completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": sum(c.truncated for c in completions) / len(completions)}


def export_folder(out: Path) -> Path:
    """The folder the weights are exported to for the engine: in shared memory where there is one (a RAM write and
    read per push), named after the run's out and owned by rank 0 while it lives (a run's start removes those of
    runs that were killed: rollout_folder.py); else under `out`."""
    run = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16]
    return SHM / f"{PREFIX}{run}" if SHM.is_dir() else Path(out) / WEIGHTS_DIR / "export"


def sample_seed(seed: int, epoch: int, record: int, sample: int) -> int:
    digest = hashlib.sha256(f"{seed}:{epoch}:{record}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Rollouts:
    def __init__(self, cfg, ps, tokenizer, chunks: Callable[[], list], part, hf_source: Path, out: Path,
                 schedule: str, engine: Engine | None = None, resume_dir: Path | None = None):
        self.cfg, self.ps, self.tok, self.chunks, self.part = cfg, ps, tokenizer, chunks, part
        self.hf_source, self.out, self.schedule, self.resume_dir = hf_source, out, schedule, resume_dir
        g, t = cfg.grpo, cfg.train
        check_batch_layout(t.global_batch_size, t.micro_batch_size, ps.dp, ps.dp_rank)
        self.funcs = [resolve(n) for n in g.reward_funcs]
        self.weights = torch.tensor(g.reward_weights or [1.0] * len(self.funcs))
        self.reader = self._reader((0, 0))
        self.eval_prompts = None  # rank 0's, read at the first evaluation
        self.report = DataReport()
        self.engine, self.owns_engine = engine, engine is None  # a given engine: the caller closes it
        self.export_dir = export_folder(out)
        self.shm = RolloutFolder(self.export_dir) if ps.rank == 0 and self.export_dir.parent == SHM else None
        if self.shm is not None:
            self.shm.claim()
        # an in-process engine, once built, takes the live tensors themselves (every rank knows which it is, and
        # learns from rank 0's first generation whether its model takes its stored tensors by name)
        self.in_memory = hasattr(engine, "load_tensors") if engine is not None else g.generator == "transformers"
        self.generation: Generation | None = None  # the current generation batch, as rank 0 broadcast it
        self.held: list[RolloutBatch] = []  # its global batches, this rank's share of each
        self.uses = 0  # how many of its len(held) x num_iterations steps have taken one
        self.step = 0

    @property
    def inside_generation(self) -> bool:
        """Steps are left of the current generation batch: a checkpoint now keeps it (`write_checkpoint`)."""
        return 0 < self.uses < len(self.held) * self.cfg.grpo.num_iterations

    def state_dict(self) -> dict[str, Any]:
        state = {"cursor": list(self.reader.cursor), "report": self.report.state_dict()}
        if self.inside_generation:
            state["held_uses"] = self.uses
        return state

    def write_checkpoint(self, folder: Path) -> None:
        """Every rank, into a checkpoint being saved: the current generation batch where steps are left of it."""
        if self.inside_generation:
            rollout_checkpoint.save(folder, self.ps, self.generation, self.held)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """The prompt cursor; and a generation batch the checkpoint kept (`held_uses` of its steps taken), which the
        next steps take as the uninterrupted run's did. CheckpointError if this run's settings cut it otherwise."""
        self.reader = self._reader(tuple(d["cursor"]))
        self.report.load_state_dict(d["report"])
        uses = d.get("held_uses")
        if uses is None:
            return
        g, n = self.cfg.grpo, self.cfg.train.global_batch_size
        generation, table = rollout_checkpoint.load(self.resume_dir)
        size, steps = len(generation.completions), g.generation_steps(n)
        if not (isinstance(uses, int) and size == steps * n and 0 < uses < steps * g.num_iterations):
            raise CheckpointError(
                f"{self.resume_dir / ROLLOUT_DIR}: holds a generation batch of {size} completions, {uses!r} of its "
                f"steps taken; this run's generation batch is {steps * n} completions (train.global_batch_size "
                f"{n} x {steps} steps), used grpo.num_iterations {g.num_iterations} times: resume with the "
                "checkpoint's settings, or from a checkpoint at a generation boundary")
        self.generation, self.held, self.uses = generation, self._pack(generation, table), uses

    def _reader(self, cursor: tuple[int, int]) -> PromptReader:
        """The training prompts from `cursor` on (the held-out ones, `data.eval_split`, left out)."""
        data = self.cfg.data
        return PromptReader(data.sources[0], self.tok, data.seq_len - self.cfg.grpo.max_completion_length, cursor,
                            seed=data.seed, eval_split=data.eval_split)

    @property
    def epoch(self) -> float | None:
        """Epochs of prompts drawn (as `TrainData.epoch`); None for a streamed source of unknown length."""
        size = self.reader.source.train_size
        return None if not size else self.reader.epoch + self.reader.record / size

    @property
    def split(self) -> list[tuple[str, int | None, int]]:
        """The prompt source's (name, records per epoch, held-out records), as `TrainData.split`."""
        source = self.reader.source
        return [(source.name, source.train_size, source.held_size)]

    def close(self) -> None:
        """Stops the engine (a vLLM worker process) and drops the shared-memory export; also when the run failed."""
        engine, self.engine = self.engine, None
        if engine is not None and self.owns_engine:
            engine.close()
        if self.shm is not None:
            self.shm.release()

    def __iter__(self):
        return self

    def __next__(self) -> RolloutBatch:
        if self.uses < len(self.held) * self.cfg.grpo.num_iterations:
            self.uses += 1
            return self.held[(self.uses - 1) % len(self.held)]
        t0 = time.perf_counter()
        weights = self._push_weights()
        pushed = time.perf_counter() - t0
        payload, error = [None], None
        if self.ps.rank == 0:
            try:
                payload = [self._generate(weights, pushed)]
            except HfmegError as e:  # a reward function's failure, a bad prompt: every rank stops with its line
                error = e
        agree(error, self.ps.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        completions, advantages, masked, metrics, in_place = payload[0]
        self.in_memory = self.in_memory and in_place  # the next pushes: tensors in place, or a folder to build from
        self.report.documents += len(completions)
        self.generation = Generation(completions, advantages, masked, metrics)
        self.held, self.uses = self._pack(self.generation), 1
        return self.held[0]

    def evaluate(self) -> dict[str, float]:
        """Collective: the current weights pushed, the held-out prompts' greedy completions scored (module doc)."""
        weights = self._push_weights()
        payload, error = [None], None
        if self.ps.rank == 0:
            try:
                payload = [self._evaluate(weights)]
            except HfmegError as e:
                error = e
        agree(error, self.ps.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _evaluate(self, weights) -> dict[str, float]:
        self._load_engine(weights)
        if self.eval_prompts is None:
            self.eval_prompts = eval_prompts(self.cfg.data, self.tok, self.reader.limit)
        params = SamplingParams(self.cfg.grpo.max_completion_length, temperature=0)
        n, completions, rewards = self.cfg.train.global_batch_size, [], []
        for lo in range(0, len(self.eval_prompts), n):
            prompts = self.eval_prompts[lo:lo + n]
            batch = self.engine.generate([p.ids for p in prompts], params, [0] * len(prompts))
            completions += batch
            rewards.append(self._score(prompts, 1, batch)[2])
        rewards = torch.cat(rewards)
        return {**reward_metrics(rewards, weighted_total(rewards, self.weights), [name_of(f) for f in self.funcs]),
                **completion_metrics(completions)}

    def _push_weights(self):
        """Collective: the current weights for the engine, on rank 0 (None elsewhere): an HF folder (the first push,
        which builds the engine, and every vLLM push), or the tensors that changed (`ModelPart.live_weights`) for
        an in-process engine built already. Either way from the shards gathered in memory, no checkpoint written."""
        chunks = self.chunks()
        layout = chunks_layout(chunks, self.ps, None, pp_layers=self.cfg.parallel.pp_layers)
        first, self.step = self.step == 0, self.step + 1
        if self.in_memory and not first:
            return self.part.live_weights(chunks, layout, self.hf_source)
        return self.part.export_live(chunks, layout, self.hf_source, self.export_dir / "hf")

    def _generate(self, weights, pushed: float):
        g = self.cfg.grpo
        t0 = time.perf_counter()
        self._load_engine(weights)
        steps = g.generation_steps(self.cfg.train.global_batch_size)
        prompts = self.reader.take(steps * self.cfg.train.global_batch_size // g.num_generations)
        ids = [p.ids for p in prompts for _ in range(g.num_generations)]
        # the prompt's own epoch: a batch that starts a new epoch (the cursor at the last one's end) is of that epoch
        seeds = [sample_seed(self.cfg.train.seed, p.epoch, p.index, k) for p in prompts
                 for k in range(g.num_generations)]
        params = SamplingParams(g.max_completion_length, g.temperature, g.top_p, g.top_k)
        loaded = time.perf_counter()
        completions = self.engine.generate(ids, params, seeds)
        generated = time.perf_counter()
        as_given, texts, rewards = self._score(prompts, g.num_generations, completions)
        advantages, metrics = group_advantages(rewards, self.weights, g, [name_of(f) for f in self.funcs])
        metrics.update(completion_metrics(completions))
        # seconds: gathering the weights (exporting them to a folder, or copying them in) plus the engine's load (its
        # start, the first time); sampling
        metrics["timing/weight_push_s"] = pushed + loaded - t0
        metrics["timing/generation_s"] = generated - loaded
        masked = [c.truncated for c in completions] if g.mask_truncated_completions else None
        with open(self.out / COMPLETIONS_FILE, "a") as f:
            for i in range(g.num_generations):
                f.write(json.dumps(dict(step=self.step, prompt=as_given[i], completion=text_of(texts[i]),
                                        rewards=[None if r != r else r for r in rewards[i].tolist()],
                                        advantage=float(advantages[i]))) + "\n")
        return completions, advantages, masked, metrics, getattr(self.engine, "in_place", True)

    def _load_engine(self, weights) -> None:
        """The engine with the pushed weights (`_push_weights`): started the first time (`grpo.generator`'s), loaded
        after (a folder, or the tensors in place)."""
        if self.engine is not None:
            self.engine.load(weights) if isinstance(weights, Path) else self.engine.load_tensors(weights)
            return
        hf = weights
        tok = self.tok
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.cfg.grpo.generator == "vllm":
            self.engine = VLLMEngine(hf, [tok.eos_token_id], pad, log=self.out / VLLM_LOG,
                                     max_model_len=self.cfg.data.seq_len,
                                     gpu_memory_utilization=self.cfg.grpo.vllm_gpu_memory_utilization)
        else:
            self.engine = TransformersEngine(hf, [tok.eos_token_id], pad)

    def _score(self, prompts, copies: int, completions) -> tuple[list, list, torch.Tensor]:
        """(the prompts as given, the completions as the reward functions see them, their rewards `[N, functions]`)
        of `completions`, `copies` consecutive ones of each prompt."""
        texts = [self.tok.decode(c.completion_ids, skip_special_tokens=True) for c in completions]
        as_given = [p.text for p in prompts for _ in range(copies)]
        if isinstance(as_given[0], list):  # conversational: TRL hands the reward a message list
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        keys = sorted({k for p in prompts for k in p.columns})
        columns = {k: [p.columns.get(k) for p in prompts for _ in range(copies)] for k in keys}
        return as_given, texts, score(self.funcs, as_given, texts, columns)

    def _pack(self, generation: Generation, old_logps: torch.Tensor | None = None) -> list[RolloutBatch]:
        """The generation batch as its steps' global batches, this rank's share of each (module doc, 3.); π_old from a
        forward pass of the current weights, or where a checkpoint kept it, from its table (`rollout_checkpoint.load`)."""
        n, g = self.cfg.train.global_batch_size, self.cfg.grpo
        completions, advantages, masked, metrics = (generation.completions, generation.advantages, generation.masked,
                                                    generation.metrics)
        steps = [slice(lo, lo + n) for lo in range(0, len(completions), n)]
        kept = [len(c.completion_ids) for i, c in enumerate(completions) if not (masked and masked[i])]
        dapo_tokens = max(sum(kept), 1) / len(steps) if len(steps) > 1 else None
        batches = [self._pack_step(completions[s], advantages[s], masked[s] if masked else None, metrics, dapo_tokens)
                   for s in steps]
        if (len(steps) > 1 or g.num_iterations > 1) and old_logps is not None:
            batches = rollout_checkpoint.restore_old_logps(batches, self.ps, old_logps, self.resume_dir)
        elif len(steps) > 1 or g.num_iterations > 1:  # π_old: the policy as it generated, by the training forward
            batches = [replace(b, microbatches=annotate_logps(self.chunks(), b.microbatches, self.ps, self.schedule,
                                                              "old_logps")) for b in batches]
        return batches

    def _pack_step(self, completions, advantages, masked, metrics, dapo_tokens) -> RolloutBatch:
        ps, t = self.ps, self.cfg.train
        share = len(completions) // ps.dp
        lo = ps.dp_rank * share
        mine = slice(lo, lo + share)
        # Rows as long as the step's longest prompt + completion (rounded up so that CP's 2 x CP chunks and sequence
        # parallelism cut them), not data.seq_len: with one completion a row, the padding after it was most of the
        # training forward's tokens. Every rank sees the whole batch, so every micro-batch of a step has one shape.
        align = 2 * ps.cp * ps.tp
        longest = max(len(c.prompt_ids) + len(c.completion_ids) for c in completions)
        seq_len = min(self.cfg.data.seq_len, -(-longest // align) * align)
        mbs = pack_completions(completions[mine], advantages[mine], 1, seq_len,
                               self.tok.eos_token_id, rows=t.micro_batch_size,
                               masked=masked[mine] if masked else None)
        mbs = [mb.shard(ps.cp_rank, ps.cp) for mb in mbs]
        tokens = sum(len(c.completion_ids) for i, c in enumerate(completions) if not (masked and masked[i]))
        return RolloutBatch(mbs, tokens, len(completions), metrics, dapo_tokens)
