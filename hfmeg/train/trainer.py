"""The training loop: data -> pipeline schedule -> overlapped optimizer, with checkpoints.

One step:
1. the data pipeline yields this DP rank's micro-batches of global batch k and the
   global count of label tokens (the loss normaliser);
2. the pipeline schedule runs every micro-batch forward and backward; on each
   chunk's last micro-batch the optimizer's hooks start the bucketed reduce-scatter;
3. `opt.step()` waits for what is still in flight, clips, updates its fp32 shard and
   starts the all-gathers that the next forward waits on bucket by bucket;
4. the loss (summed over the last stage's DP ranks = the global-batch mean) is
   logged by rank 0, with MoE models the min/max tokens per expert of each MoE layer
   (`expert_load`); evaluation, checkpointing and a requested stop follow.

Around the loop: rank 0 holds `<out>`'s run lock from start to end (`run_lock.py`);
a worker whose launcher dies stops (`stop.LauncherWatch`); a peer silent for `train.heartbeat_timeout_s` ends
every other rank with one line naming it (`parallel/heartbeat.py`), also where a collective failed first; `train.max_skipped_steps`
skipped steps in a row (non-finite gradients: the run has diverged) save a
checkpoint and abort with `TrainingDiverged`. After the final checkpoint, the last
collective of the run, rank 0 alone exports (and uploads) while the other ranks
return: a rank waiting in a barrier through an upload of many GB would be killed by
the NCCL watchdog's timeout. Rank 0 then prints the run's summary (`summary.py`). The end
of a run is a state like any other: the export finishes by writing `<out>/export.json`, and
a run that resumes at `max_steps` without it (the last one died in its export or upload)
exports then, and prints the summary from the saved metrics.
With `parallel.layout: auto` the planner chooses the layout before anything is built,
and its prediction is checked against the first timed steps (`auto_layout.py`).
A preference run (`preference.loss_type`, `preference.py`) trains on pairs: each step the reference
model (`parts/reference.py`: a frozen copy, or the base with the adapters off) first computes every
sequence's log-probability forward-only, then the policy's forward and backward reduce the pairs' DPO
loss instead of the next-token loss; its rewards and log-probabilities are logged beside the loss.
The model is a part (`parts/`): a full model or adapters on a frozen base, which builds its chunks,
writes its share of a checkpoint, checks a resume and exports through one interface, so the loop never
asks which it holds. A part may ask to be rebuilt through a checkpoint at a step (`_rebuild`): with
`train.shared_layers_until` every layer shares layer 0's parameters until that step
(`models/shared_layers.py`), and the model and optimizer continue unshared from there.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from ..checkpoint.mp_layout import DTYPES
from ..data import build_data, build_eval_data
from ..errors import CheckpointError, DataError, HfmegError
from ..models.moe import expert_load
from ..optim.distributed_optimizer import DistributedOptimizer
from ..optim.lr_schedule import lr_at
from ..parallel import threads
from ..parallel.agree import agree
from ..parallel.heartbeat import Heartbeat
from ..parallel.rendezvous import rejoin_warning
from ..parallel.pipeline import TokenMean, forward_backward
from ..parallel.state import ParallelState, join_world, ranks_per_host
from ..plan.flops import mfu, peak_flops
from .auto_layout import LayoutReport, resolve_layout
from .checkpointing import (HF_SOURCE_DIR, STATE_FILE, RunCheckpoints, load_trainer_state, read_trainer_state,
                            rng_not_restored)
from .config import TrainConfig
from .dataclass_io import to_yaml
from .export import EXPORT_RECORD, export_run
from .metrics import METRICS_FILE, MetricsLog, last_losses
from .parts import part_class
from .preflight import check_inputs
from .parts.reference import Precomputed, Reference
from .preference import PreferenceLoss
from .rng import seed_all
from .run_lock import LOCK_FILE, lock_run
from .stop import GracefulStop, LauncherWatch, exit_together
from .summary import RunSummary
from .trackers import Trackers


DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
CONFIG_FILE = "config.yaml"  # the config the run trains with, as `hfmeg train --print-config` prints one


class TrainingDiverged(HfmegError):
    """Too many optimizer steps in a row were skipped for non-finite gradients."""


@dataclass
class RunResult:
    out: Path
    steps: int
    final_loss: float | None
    checkpoint: Path | None
    hf_folder: Path | None
    stopped_by_signal: bool
    exit_code: int  # the process's: 0, or 128 + the signal that stopped the run (agreed over the ranks)
    is_logger: bool  # global rank 0, which logs and exports; hf_folder is None on the other ranks
    summary: RunSummary


def _sum_over_world(values: torch.Tensor) -> list[float]:
    """The sums over ranks of a vector of per-rank values, read in one host sync."""
    if dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values.tolist()


class Trainer:
    def __init__(self, cfg: TrainConfig):
        # The process group is the trainer's to end only where it made it (not a caller's, e.g. launch.spawn's).
        self.owns_world = not dist.is_initialized()
        self.stop = GracefulStop()  # held to the end (`_leave`): a signal during start-up or export is no traceback
        try:
            device = join_world(timeout_s=cfg.train.collective_timeout_s)
            self.heartbeat = Heartbeat.start(cfg.train.heartbeat_timeout_s, device)
        except BaseException:
            self.stop.restore()
            raise
        try:
            self._start(cfg, device)
        except BaseException as e:
            self._leave(e)
            raise

    def _leave(self, error: BaseException | None = None) -> None:
        """This rank is done with its peers: after a failed collective, a peer found lost ends the process with
        one line (`Heartbeat.wait_verdict`), and so does a signal (the launcher stopping the workers once one
        died); otherwise the heartbeat stops, so that its silence is no loss."""
        if getattr(error, "agreed", False):  # every rank raised it together, so every rank is here
            exit_together()
            dist.barrier()  # no rank exits (and has its launcher stop the others) before all ignore SIGTERM
        if self.heartbeat is not None:
            if error is not None and self.heartbeat.wait_verdict(error, until=lambda: self.stop.requested):
                self.heartbeat.signalled(self.stop.signal_name, error, self.stop.exit_code)
            self.heartbeat.stop()
        self.stop.restore()
        if self.owns_world and dist.is_initialized():
            # gloo's and the store's threads end here, not in the interpreter's teardown, where a thread still
            # joinable aborts the process ("terminate called without an active exception"); after an error too,
            # once the heartbeat found no peer lost (it ends the process itself when one is)
            dist.destroy_process_group()

    def _start(self, cfg: TrainConfig, device: torch.device) -> None:
        cfg, self.prediction = resolve_layout(cfg, device)  # the planner's layout with parallel.layout auto
        self.cfg = cfg
        self.ps = ParallelState(cfg.parallel, dist.get_rank(), dist.get_world_size(), device, ranks_per_host())
        self.launcher = LauncherWatch.start()
        self.is_logger = self.ps.rank == 0
        self.out = Path(cfg.checkpoint.out)
        check_inputs(cfg, device)  # before the lock, the first thing a run writes
        self.lock = lock_run(self.out, self.ps)
        try:
            ck = cfg.checkpoint
            self.checkpoints = RunCheckpoints(self.out, keep_last=ck.keep_last, resume=ck.resume,
                                              overwrite=ck.overwrite, device=self.ps.device)
            if self.is_logger:  # holding the lock: whatever a save or export left half-written is a dead run's
                for path in self.checkpoints.remove_stale():
                    print(f"removed {path}, left half-written by a run that died", flush=True)
                for note in self.checkpoints.notes:
                    print(note, flush=True)
            self._setup()
        except BaseException:
            if self.lock is not None:  # a run that failed at start-up leaves no trace of itself
                started = self._started()
                if not started:
                    shutil.rmtree(self.out / HF_SOURCE_DIR, ignore_errors=True)
                self.lock.release(forget=not started)
            raise

    def _started(self) -> bool:
        """Whether `<out>` holds anything of a run (checkpoints, metrics, an export) beyond what start-up
        writes: the lock and the copied HF side files."""
        return any(p.name not in (LOCK_FILE, HF_SOURCE_DIR) for p in self.out.iterdir())

    def _setup(self) -> None:
        cfg = self.cfg
        self.schedule = cfg.parallel.run_schedule
        seed_all(cfg.train.seed)
        self.dtype = cfg.model.torch_dtype(self.ps.device)
        cfg.model.dtype = DTYPE_NAMES[self.dtype]  # `auto` resolved: config.yaml, the checkpoints and the card say it
        self.resume_dir = self.checkpoints.resume_dir
        saved, error = {}, None
        try:  # every rank reads its own part of the checkpoint; they agree before the next collective
            saved = read_trainer_state(self.resume_dir) if self.resume_dir is not None else {}
            self.step = saved.get("step", 0)
            self.part = part_class(cfg)(cfg, self.ps, self.dtype)
            if self.resume_dir is not None:  # a changed setting is named as such, not as a file it lacks
                self.part.check_resume(self.resume_dir)
            self.chunks, hf_side_dir = self.part.build(self.resume_dir, self.step)
            if self.is_logger:
                self.checkpoints.pin_hf_source(hf_side_dir)
        except HfmegError as e:
            error = e
        except OSError as e:  # e.g. a full disk under pin_hf_source
            error = CheckpointError(f"{e.filename or self.out}: {e.strerror or e}")
        agree(error, self.ps.device)
        try:  # a collective: what rank 0 alone checks (an adapter run's base), for every rank
            self.part.check_base(saved)
        except HfmegError as e:
            error = e
        agree(error, self.ps.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(hf_side_dir))
        self.opt = DistributedOptimizer(self.chunks, self.ps, cfg.optim)
        loop = cfg.train
        data_args = dict(dp_rank=self.ps.dp_rank, dp_size=self.ps.dp, micro_batch_size=loop.micro_batch_size,
                         global_batch_size=loop.global_batch_size, cp_rank=self.ps.cp_rank, cp_size=self.ps.cp)
        # Micro-batches go to the device and get their attention masks in the data thread, ahead of their step.
        self.stager = self.chunks[0].stager()
        self.data_args = data_args
        self.data = self._build_data()
        self.last_save: tuple[int, Path] | None = None  # (step, folder) of this run's newest checkpoint
        if self.resume_dir is not None:
            load_trainer_state(self.resume_dir, self.opt, self.part.optimizer_names(saved))
            try:
                self.data.load_state_dict(saved["data"])
            except DataError as e:
                error = CheckpointError(f"{self.resume_dir / STATE_FILE}: field data: {e}")
            except CheckpointError as e:  # a file the data keeps beside its state (`_write_data`)
                error = e
            agree(error, self.ps.device)
            if self.is_logger:
                print(f"resuming from {self.resume_dir} (step {self.step})")
                not_restored = rng_not_restored(self.resume_dir, dist.get_world_size())
                note = self.part.resume_note(not_restored) if not_restored else None
                if note:
                    print(note, flush=True)
        self.model_cfg = self.chunks[0].cfg
        self.peak = peak_flops(self.ps.device)
        self.reference = self._reference()

    def _build_data(self):
        """The stream of global batches the loop trains on (a GRPO run's: its rollouts, grpo_trainer.py)."""
        return build_data(self.cfg.data, self.tokenizer, stage=self.stager, **self.data_args)

    def _objective(self, batch):
        """The loss of a global batch: a preference loss (which keeps its metrics), or None for the next-token loss."""
        pref = self.cfg.preference
        return PreferenceLoss(pref, self.ps, batch.num_pairs, batch.chosen_tokens) if pref.enabled else None

    def _reference(self) -> Reference | Precomputed | None:
        """A preference loss's reference model, whose log-probabilities come first each step; or, precomputed, those
        of every batch this session trains and evaluates on, computed now (parts/reference.py)."""
        pref = self.cfg.preference
        if not pref.needs_reference:
            return None
        reference = self.part.reference(self.chunks)
        if pref.reference == "live":
            return reference
        started = time.perf_counter()
        stored = Precomputed.compute(reference, self._batches_ahead(), self.ps, self.schedule)
        if self.is_logger:
            print(f"reference log-probabilities of {len(stored.stored)} batches computed ahead in "
                  f"{time.perf_counter() - started:.0f}s; the reference model is dropped", flush=True)
        return stored

    def _batches_ahead(self):
        """(key, micro-batches) of every batch this session will train on, from a second reader of the data at the
        same position, then of the eval batches."""
        cfg = self.cfg
        ahead = build_data(cfg.data, self.tokenizer, stage=self.stager, **self.data_args)
        ahead.load_state_dict(self.data.state_dict())
        try:
            for step in range(self.step, cfg.train.max_steps):
                yield ("train", step), self.stager.take(next(ahead))
        finally:
            ahead.close()
        if cfg.train.eval_every:
            for i, batch in self._eval_batches():
                yield ("eval", i), batch.microbatches

    def _eval_batches(self):
        """(index, batch) of the eval batches an evaluation reads."""
        batches = build_eval_data(self.cfg.data, self.tokenizer, **self.data_args)
        return zip(range(self.cfg.train.eval_batches), batches)

    def _rebuild(self, note: str) -> None:
        """Rebuild the model part and the optimizer through a checkpoint at this step (`ModelPart.rebuild_note`).

        That checkpoint is the switch-over's resume point: the new chunks load from its model shards (a full
        model unsharing its layers: every layer holds the shared weights, so it computes exactly what the
        shared one did), and a new optimizer from its optimizer state, each parameter's taken from the names
        the part says (every layer's from the first layer's), re-partitioned over the new buckets as a resume
        at another DP size would be. A resume from that checkpoint does the same, so the run continues
        identically either way."""
        folder = self.last_save[1] if self.last_save and self.last_save[0] == self.step else self.save()
        self.opt.data_parallel.grad_sync.remove_hooks()  # they would keep the old model alive
        self.chunks, _ = self.part.build(folder, self.step)
        self.opt = DistributedOptimizer(self.chunks, self.ps, self.cfg.optim)
        load_trainer_state(folder, self.opt, self.part.optimizer_names(read_trainer_state(folder)))
        if self.is_logger:
            print(note, flush=True)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            with logging_redirect_tqdm():  # warnings (e.g. the data's) on lines of their own, above the bar
                summary = self._train()
            if self.is_logger and summary.stopped_by is None:
                final = summary.checkpoint or self._unexported_final()
                summary.hf = self.export(final) if final is not None else self._exported()
        except BaseException as e:
            self._leave(e)
            raise
        else:
            self._leave()
        finally:
            if self.lock is not None:
                self.lock.release()
        if self.is_logger:
            print("\n".join(summary.lines()), flush=True)
        return RunResult(self.out, self.step, summary.train_loss, summary.checkpoint, summary.hf,
                         summary.stopped_by is not None, self.stop.exit_code if summary.stopped_by else 0,
                         self.is_logger, summary)

    def _train(self) -> RunSummary:
        cfg, ps = self.cfg, self.ps
        if self.is_logger:
            for line in self.checkpoints.set_aside():  # started: what lies above the resume point is moved
                print(line, flush=True)
            (self.out / CONFIG_FILE).write_text(to_yaml(cfg))
            print(f"config: {self.out / CONFIG_FILE}", flush=True)
            if ps.grid.hosts > 1:
                print(f"hosts: {ps.grid.hosts_line()}", flush=True)
            if (warning := rejoin_warning()) is not None:
                print(warning, file=sys.stderr, flush=True)
        summary = RunSummary(self.out, self.step, self.step, cfg.train.max_steps)
        metrics = None
        if self.is_logger:
            trackers = Trackers(cfg.report_to, self.out, cfg.to_dict()) if cfg.report_to else None
            metrics = MetricsLog(self.out, cfg.train.max_steps, self.step, trackers)
        check = None if self.prediction is None else LayoutReport(self.prediction, self.step, cfg.train.max_steps,
                                                                  ps.device)
        stop = self.stop
        skipped_in_a_row, stopped = 0, False
        seq_len = cfg.data.seq_len
        tokens_per_step = cfg.train.global_batch_size * seq_len
        started = time.perf_counter()
        try:
            while not self._done():
                self.launcher.check()
                threads.rebalance()  # a process alone on its host: threads for the machine's load now
                note = self.part.rebuild_note(self.step)
                if note:
                    self._rebuild(note)
                lr = lr_at(self.step, cfg.optim.lr, cfg.lr)
                self.opt.set_lr(lr)
                t0 = time.perf_counter()  # the step's time includes waiting for its data
                batch = next(self.data)
                local, objective = self._forward_backward(batch, self.stager.take(batch), ("train", self.step))
                result = self.opt.step()
                loss, objective = self._read(local, objective)
                load = {"expert_load": expert_load(self.chunks, ps)} if self.model_cfg.moe is not None else {}
                dt = time.perf_counter() - t0
                self.step += 1
                if self.heartbeat is not None:
                    self.heartbeat.step = self.step  # its beats report it: a lost rank is named with its step
                summary.step, summary.train_loss = self.step, loss
                summary.tokens += batch.num_tokens
                summary.skipped += result.skipped
                skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
                if metrics is not None:
                    tps = tokens_per_step / dt
                    metrics.log_step(dict(
                        step=self.step, loss=loss, lr=lr, grad_norm=result.grad_norm, tokens=batch.num_tokens,
                        tokens_per_s=tps, skipped=result.skipped, epoch=self.data.epoch,
                        mfu=mfu(self.model_cfg, tps, seq_len, self.peak, ps.world_size) if self.peak else None,
                        objective=objective, **load))
                line = check.after_step(self.step, dt) if check is not None else None  # every rank: a collective
                if line and metrics is not None:
                    metrics.bar.write(line)
                if 0 < cfg.train.max_skipped_steps <= skipped_in_a_row:
                    saved = self.save()
                    raise TrainingDiverged(
                        f"train.max_skipped_steps: {skipped_in_a_row} steps in a row skipped for non-finite "
                        f"gradients (the run diverged; optim.lr is {cfg.optim.lr:g}); saved step {self.step} to "
                        f"{saved} for inspection, not exported")
                summary.objective = objective
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    (summary.eval_loss, summary.eval_objective), summary.eval_step = self.evaluate(), self.step
                    if metrics is not None:
                        metrics.log_eval(self.step, summary.eval_loss, summary.eval_objective)
                stopped = stop.should_stop(ps.device)
                due = cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0
                if due or stopped or self._done():
                    summary.checkpoint = self.save()
                if stopped:
                    summary.stopped_by = stop.signal_name
                    if metrics is not None:
                        metrics.bar.write(f"{stop.signal_name}: saved step {self.step} to {summary.checkpoint}, "
                                          "exiting")
                    break
        finally:
            self.data.close()  # stops the prefetch thread, also when the loop raised
            if metrics is not None:
                metrics.close()
        summary.seconds = time.perf_counter() - started
        summary.data = self.data.report  # read at the end: the data pipeline may hand out a snapshot
        summary.epoch, summary.split = self.data.epoch, self.data.split
        if self.is_logger and summary.train_loss is None:  # no step in this session: what the run logged last
            summary.train_loss, summary.eval_loss, summary.eval_step = last_losses(self.out / METRICS_FILE)
        return summary

    def _done(self) -> bool:
        """train.max_steps taken, or train.num_epochs epochs of data drawn: the first reached. Every rank reads the
        same data state, so all stop at the same step without a collective."""
        epochs = self.cfg.train.num_epochs
        if self.step >= self.cfg.train.max_steps:
            return True
        if epochs is None:
            return False
        drawn = self.data.epoch
        if drawn is None:
            raise DataError("train.num_epochs: a streamed data source's length is unknown, so are its epochs; "
                            "stop the run with train.max_steps")
        return drawn >= epochs

    def _forward_backward(self, batch, mbs, key: tuple[str, int]) -> tuple[torch.Tensor, PreferenceLoss | None]:
        """One global batch, `key` ("train", step) or ("eval", index), through the pipeline (forward only for eval):
        this rank's share of the loss, a 0-dim device tensor (last stage; zero elsewhere), and the preference loss
        that holds the batch's metrics."""
        ps = self.ps
        objective = self._objective(batch)
        if self.reference is not None:
            mbs = self.reference.annotate(mbs, ps, self.schedule, key)
        train = key[0] == "train"
        run = dict(grad_sync=self.opt, loss_scale=self.opt.loss_scale) if train else dict(forward_only=True)
        local = forward_backward(self.chunks, ps, mbs, schedule=self.schedule, sync_loss=False,
                                 loss=objective or TokenMean(batch.num_tokens), **run)
        return (local if local is not None else torch.zeros((), device=ps.device)), objective

    def _read(self, local: torch.Tensor, objective: PreferenceLoss | None) -> tuple[float, dict[str, float]]:
        """The global batch's loss and objective metrics, summed over the ranks in one collective: the loss from
        every last-stage rank of TP rank 0 (its DP x CP parts), the metrics from those of CP rank 0 (each CP rank
        holds the whole pairs' values)."""
        ps = self.ps
        last = ps.is_last_stage and ps.tp_rank == 0
        values = [local.double() * last]
        if objective is not None:
            values.append(objective.totals * (last and ps.cp_rank == 0))
        sums = _sum_over_world(torch.cat([v.reshape(-1) for v in values]))
        return sums[0], objective.metrics(sums[1:]) if objective is not None else {}

    @torch.no_grad()
    def evaluate(self) -> tuple[float, dict[str, float]]:
        """Mean loss over the eval batches (each normalised by its own token or pair count), and the mean of the
        objective's metrics (a preference run's rewards) over them."""
        losses, objectives = [], []
        for i, batch in self._eval_batches():
            loss, objective = self._read(*self._forward_backward(batch, batch.microbatches, ("eval", i)))
            losses.append(loss)
            objectives.append(objective)
        n = max(len(losses), 1)
        return sum(losses) / n, {k: sum(o[k] for o in objectives) / n for k in (objectives[0] if objectives else {})}

    def save(self) -> Path:
        state = {"data": self.data.state_dict(), "config": self.cfg.to_dict(),
                 "shared_layers": self.part.layers_shared, "dp": self.ps.dp, **self.part.checkpoint_state()}
        folder = self.checkpoints.save(self.step, self.chunks, self.ps, self.opt, state,
                                       pp_layers=self.cfg.parallel.pp_layers, write_model=self.part.write_model,
                                       write_data=self._write_data)
        self.last_save = (self.step, folder)
        return folder

    def _write_data(self, folder: Path) -> None:
        """Every rank, into a checkpoint being saved: what the data keeps beside its state in trainer_state.json (a GRPO
        run's generation batch, grpo_trainer.py); an SFT or DPO run's data state is its position alone."""

    def _unexported_final(self) -> Path | None:
        """After a session that ran no step: the final checkpoint it resumed from, if the run that saved it
        died before its export (and push) finished, which `<out>/EXPORT_RECORD` says."""
        if self.resume_dir is None or not self._done() or self._exported() is not None:
            return None
        return self.resume_dir

    def _exported(self) -> Path | None:
        """`<out>/hf`, if it holds the export of this step (and was pushed where asked)."""
        try:
            record = json.loads((self.out / EXPORT_RECORD).read_text())
        except (OSError, ValueError):
            return None
        done = record == {"step": self.step, "pushed_to": self.cfg.hub.push_to_hub}
        return self.out / "hf" if done and (self.out / "hf" / "config.json").is_file() else None

    def export(self, checkpoint: Path | None) -> Path | None:
        """Rank 0 alone: `export_run` of the final checkpoint (`<out>/hf`, a LoRA run's `<out>/adapter`, the cards,
        the push if asked). No collective may follow the final checkpoint (see the module docstring)."""
        if checkpoint is None:
            return None
        return export_run(self.out, checkpoint, self.cfg, step=self.step, skipped_steps=self.opt.skipped_steps,
                          dp=self.ps.dp)
