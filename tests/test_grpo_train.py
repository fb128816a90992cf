"""End-to-end GRPO on stories260K with a verifiable toy reward (`recipes/grpo_toy_rewards.py:park`).

A one-process run and a TP2 x PP2 one: each step both push their weights to the transformers engine (the live
shards gathered and merged as the export merges them, tests/test_weight_push.py) and sample the same prompts with the same seeds, so they must score the same
completions (rewards equal exactly) and compute the same loss; the generator's log-probabilities agree with
the training forward's (the mismatch metric); bad input is refused in one line.

Bounds: on-policy (num_iterations 1, beta 0) the DAPO loss is Σ −A_i n_i / T over the completions whatever the
log-probabilities (every importance weight is exp(0) = 1), so the two layouts' losses differ by the float32
rounding of that sum (T terms of at most max|A| = (G − 1)/√G each: T · 2⁻²⁴ · max|A|); their gradient norms,
sums the layouts add in another order, within the suite's layout bound EPS relative; the mismatch, a mean of
|π_train − π_generator|, is within 2 TOL (both within TOL of transformers' logits, test_grpo_generation.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bounds import within
from helpers import stories_or_skip

from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.dataclass_io import ConfigError
from hfmeg.train.grpo import MISMATCH, GRPOSettings
from hfmeg.train.grpo_trainer import GRPOTrainer
from hfmeg.train.metrics import read_metrics
from hfmeg.train.validate import validate

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PROMPTS = ["Once upon a time", "One day, a little girl named Lily", "Tom and his mom went to the", "The cat saw a big"]
TOL = 1e-4
EPS = 1e-4  # the suite's layout bound on sums the layouts add in another order (test_train.py, test_dpo_train.py)
G = 4


def _prompts(root: Path) -> Path:
    import json

    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(dict(prompt=p)) + "\n" for p in PROMPTS))
    return path


def _config(out: Path, data: Path, *, tp=1, pp=1, steps=3, **grpo) -> TrainConfig:
    return TrainConfig(
        model=ModelArgs(path=str(stories_or_skip()), dtype="fp32"),
        parallel=ParallelArgs(tp=tp, pp=pp),
        optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1e-8),
        lr=LRScheduleConfig(warmup_steps=0, total_steps=steps),
        data=DataConfig(sources=[SourceConfig(str(data))], seq_len=64),
        grpo=GRPOSettings(**{**dict(reward_funcs=["grpo_toy_rewards:park"], num_generations=G,
                                    max_completion_length=16), **grpo}),
        train=LoopArgs(micro_batch_size=4, global_batch_size=16, max_steps=steps),
        checkpoint=CheckpointArgs(out=str(out)),
        report_to=[],
    )


def _run(cfg: TrainConfig):
    sys.path.insert(0, str(RECIPES))  # the toy reward's module, as `python recipes/grpo_llama.py` finds it
    GRPOTrainer(cfg).run()


def _rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_grpo_tp2_pp2_matches_one_process(tmp_path):
    data = _prompts(tmp_path)
    spawn(_run, 1, _config(tmp_path / "single", data))
    spawn(_run, 4, _config(tmp_path / "grid", data, tp=2, pp=2))
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "grid")
    check_layouts_agree(a, b, 3)
    completions = (tmp_path / "grid" / "completions.jsonl").read_text().splitlines()
    assert len(completions) == 3 * 4  # one group a step
    card = (tmp_path / "grid" / "hf" / "README.md").read_text()
    assert "online RL, GRPO family (dapo loss" in card and "scored by grpo_toy_rewards:park" in card
    assert "- grpo\n" in card.split("---")[1]  # the card's tags


def check_layouts_agree(a: list[dict], b: list[dict], steps: int) -> None:
    """Two runs' metrics rows (one process, TP2 x PP2) within the module's bounds; test_vllm_engine.py's too."""
    assert len(a) == len(b) == steps
    for x, y in zip(a, b):
        per_func = [k for k in x if k.startswith("rewards/")]
        assert per_func and per_func == [k for k in y if k.startswith("rewards/")]
        for k in ("reward", "reward_std", *per_func, "frac_reward_zero_std", "completions/mean_length"):
            assert x[k] == y[k], (k, x["step"])  # the same completions were sampled from both layouts' weights
        max_advantage = (G - 1) / G ** 0.5  # one group's |r - mean| / std at most (Bessel std)
        within(abs(x["loss"] - y["loss"]), x["tokens"] * 2 ** -24 * max_advantage, "grpo run loss tp2pp2 vs 1",
               x["step"])
        within(abs(x["grad_norm"] - y["grad_norm"]), EPS * x["grad_norm"], "grpo run grad norm tp2pp2 vs 1", x["step"])
        for row in (x, y):
            within(row[MISMATCH], 2 * TOL, "grpo run train/generation mismatch", x["step"])


def test_num_iterations_reuses_the_batch_against_its_old_logps(tmp_path):
    """num_iterations 2: the second step trains on the first's completions (generated once), its importance weights
    against π_old from the training forward at generation, so its loss is no longer the on-policy 0."""
    spawn(_run, 1, _config(tmp_path / "out", _prompts(tmp_path), steps=2, num_iterations=2, loss_type="grpo"))
    a, b = _rows(tmp_path / "out")
    assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
    assert len((tmp_path / "out" / "completions.jsonl").read_text().splitlines()) == G  # one generation
    assert a["clip_ratio/region_mean"] == 0 and abs(b["loss"]) > 1e-6


class ScriptedEngine:
    """Completions that depend on their seed alone, of other lengths within a group (generation is tested in
    test_grpo_generation.py); it records its calls: "load" for a push, the batch size for a generation."""

    def __init__(self):
        self.calls: list = []

    def load(self, folder) -> None:
        self.calls.append("load")

    def close(self) -> None:
        pass

    def generate(self, prompts, params, seeds):
        from hfmeg.data.rollouts import Completion

        self.calls.append(len(prompts))
        return [Completion(list(p), scripted(s, params.max_new_tokens)) for p, s in zip(prompts, seeds)]


def scripted(seed: int, limit: int) -> list[int]:
    return [100 + (seed // 7 + 13 * j) % 200 for j in range(2 + seed % (limit - 2))]


def characters(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def _run_scripted(cfg: TrainConfig) -> list:
    sys.path.insert(0, str(RECIPES))
    engine = ScriptedEngine()
    GRPOTrainer(cfg, engine=engine).run()
    return engine.calls


def _generation_config(out: Path, data: Path, steps: int, **grpo) -> TrainConfig:
    """Two optimizer steps a generation batch of 16 completions (4 prompts x 4), 8 completions a step, the scripted
    engine's completions scored by their length in characters, advantages scaled by the whole generation batch's
    std (so that a step's advantages depend on the other step's completions, as in TRL)."""
    from dataclasses import replace

    cfg = _config(out, data, steps=steps, reward_funcs=[f"{__name__}:characters"], scale_rewards="batch",
                  steps_per_generation=2, **grpo)
    return replace(cfg, train=replace(cfg.train, global_batch_size=8), lr=replace(cfg.lr, decay="constant"))


def _expected_steps(cfg: TrainConfig, epochs: int) -> list[tuple[int, float, float, float]]:
    """Per global batch of each generation batch, in order: (completion tokens, DAPO's on-policy loss in float32 and
    in float64, the generation batch's mean reward). On-policy every importance weight is 1 and a token's loss is
    −A; TRL's DAPO divides a step's sum by its generation batch's tokens × gradient_accumulation_steps /
    steps_per_generation (`num_items_in_batch` rescaled, trl GRPOTrainer._compute_loss): here the generation
    batch's tokens / 2."""
    import torch
    from transformers import AutoTokenizer

    from hfmeg.train.grpo import group_advantages
    from hfmeg.train.rollout import sample_seed

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    g = cfg.grpo
    out = []
    for epoch in range(epochs):
        completions = [scripted(sample_seed(cfg.train.seed, epoch, record, k), g.max_completion_length)
                       for record in range(len(PROMPTS)) for k in range(G)]
        rewards = torch.tensor([[float(len(tok.decode(c, skip_special_tokens=True)))] for c in completions])
        advantages = group_advantages(rewards, torch.ones(1), g, ["characters"])[0]
        lengths = torch.tensor([len(c) for c in completions])
        normaliser = float(lengths.sum()) / 2
        for half in (slice(0, 8), slice(8, 16)):
            terms = -advantages[half] * lengths[half]
            out.append((int(lengths[half].sum()), float(terms.sum() / normaliser),
                        float(terms.double().sum() / normaliser), float(rewards.mean())))
    return out


def test_a_generation_batch_feeds_steps_per_generation_steps_in_trl_order(tmp_path):
    """steps_per_generation 2, num_iterations 2: one push and one generation of 16 completions every 4 steps, whose
    global batches the steps take in TRL's order (first, second, first, second); the first step of a generation is
    on-policy (its loss DAPO's on-policy value, within float32 rounding), the three after it train against π_old
    from the weights that generated the batch, which they have moved from (the loss leaves the on-policy value)."""
    from bounds import rounding_bound

    cfg = _generation_config(tmp_path / "out", _prompts(tmp_path), 8, num_iterations=2)
    calls = spawn(_run_scripted, 1, cfg)[0]
    assert calls == ["load", 16, "load", 16]
    expected = _expected_steps(cfg, 2)
    order = [expected[i] for i in (0, 1, 0, 1, 2, 3, 2, 3)]
    rows = _rows(tmp_path / "out")
    assert [r["tokens"] for r in rows] == [tokens for tokens, *_ in order]
    assert [r["reward"] for r in rows] == pytest.approx([reward for *_, reward in order], rel=1e-6)
    for step, (row, (_, loss32, loss64, _)) in enumerate(zip(rows, order), 1):
        bound = rounding_bound(loss32, loss64)
        if step in (1, 5):
            within(abs(row["loss"] - loss64), bound, "grpo on-policy step of a generation batch", step)
        else:
            assert abs(row["loss"] - loss64) > 100 * bound, (step, row["loss"], loss64)


def test_steps_per_generation_resumes_exactly_at_a_generation_boundary(tmp_path):
    """4 steps straight == 2 steps, then a resume from the step-2 checkpoint (a generation boundary) to 4: the
    cursor regenerates the second generation batch, and every step's numbers are equal."""
    from dataclasses import replace

    data = _prompts(tmp_path)
    spawn(_run_scripted, 1, _generation_config(tmp_path / "straight", data, 4))
    cfg = _generation_config(tmp_path / "resumed", data, 4)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, save_every=2))
    spawn(_run_scripted, 1, replace(cfg, train=replace(cfg.train, max_steps=2)))
    calls = spawn(_run_scripted, 1, replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto")))[0]
    assert calls == ["load", 16]
    a, b = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for k in ("reward", "tokens", "loss", "grad_norm"):
            assert x[k] == y[k], (k, x["step"])


@pytest.mark.parametrize("stop", [1, 3])
def test_a_checkpoint_inside_a_generation_batch_resumes_exactly(tmp_path, stop):
    """steps_per_generation 2, num_iterations 2 (four steps a generation batch: first, second, first, second half):
    5 steps straight == `stop` steps (inside the first batch: after its first step, or in its second pass) and a
    resume from that checkpoint to 5. The weights that generated the batch are gone by then, so the checkpoint keeps
    the batch and its π_old (`rollout/`); the resumed run trains the batch's remaining steps on them, then pushes
    and generates once (step 5), and every step's rewards, tokens, losses and gradient norms are the uninterrupted
    run's, exactly (one process, the same fp32 arithmetic)."""
    from dataclasses import replace

    from hfmeg.train.rollout_checkpoint import GENERATION_FILE

    data = _prompts(tmp_path)
    spawn(_run_scripted, 1, _generation_config(tmp_path / "straight", data, 5, num_iterations=2))
    cfg = _generation_config(tmp_path / "resumed", data, 5, num_iterations=2)
    spawn(_run_scripted, 1, replace(cfg, train=replace(cfg.train, max_steps=stop)))
    held = tmp_path / "resumed" / "checkpoints" / f"iter_{stop:07d}" / "rollout"
    assert (held / GENERATION_FILE).is_file() and len(list(held.glob("old_logps_rank_*"))) == 1
    resume = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))
    if stop == 1:  # a run of another generation batch size cannot take the kept batch's steps: refused in one line
        other = replace(resume, grpo=replace(cfg.grpo, steps_per_generation=4))
        with pytest.raises(Exception, match=r"iter_0000001/rollout: holds a generation batch of 16 completions, 1 of "
                                            r"its steps taken; this run's generation batch is 32 completions"):
            spawn(_run_scripted, 1, other)
    calls = spawn(_run_scripted, 1, resume)[0]
    assert calls == ["load", 16]  # the second generation batch only
    a, b = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        for k in ("reward", "tokens", "loss", "grad_norm"):
            assert x[k] == y[k], (k, x["step"])
    assert not (tmp_path / "resumed" / "checkpoints" / "iter_0000004" / "rollout").exists()  # a generation boundary


def test_evaluation_scores_greedy_completions_of_the_held_out_prompts(tmp_path):
    """data.eval_split 2 of 6 prompts, train.eval_every 1: the 4 others are the training prompts (an epoch a step), and
    each evaluation logs the park reward and length of one greedy completion per held-out prompt from that step's
    weights: at step 2 those of transformers' own greedy `generate` on the run's export (the same weights)."""
    import json
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfmeg.data.prompts import eval_prompts

    sys.path.insert(0, str(RECIPES))
    from grpo_toy_rewards import park

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(dict(prompt=p)) + "\n" for p in PROMPTS + ["Lily and Ben went to play",
                                                                                "The little dog ran"]))
    cfg = _config(tmp_path / "out", data, steps=2)
    cfg = replace(cfg, data=replace(cfg.data, eval_split=2), train=replace(cfg.train, eval_every=1))
    spawn(_run, 1, cfg)
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["epoch"] for r in rows if "loss" in r] == [1.0, 2.0]  # 4 training prompts a step: none held out
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [1, 2] and "eval_loss" not in evals[0]
    tok = AutoTokenizer.from_pretrained(tmp_path / "out" / "hf")
    held = eval_prompts(cfg.data, tok, cfg.data.seq_len - cfg.grpo.max_completion_length)
    assert len(held) == 2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf", dtype=torch.float32).eval()
    completions = []
    for p in held:
        out = model.generate(torch.tensor([p.ids]), do_sample=False, max_new_tokens=16, eos_token_id=tok.eos_token_id)
        completions.append(out[0, len(p.ids):].tolist())
    texts = [tok.decode(c, skip_special_tokens=True) for c in completions]
    rewards = park([p.text for p in held], texts)
    assert evals[1]["eval_reward"] == pytest.approx(sum(rewards) / 2, abs=1e-12)
    assert evals[1]["eval_rewards/park/mean"] == evals[1]["eval_reward"]
    assert evals[1]["eval_completions/mean_length"] == sum(map(len, completions)) / 2


def broken(prompts, completions, **kwargs):
    raise ValueError("no answer column")


def test_a_failing_reward_stops_every_rank_in_one_line(tmp_path):
    """At DP 2 rank 0 scores; its failure reaches the other rank instead of leaving it waiting for the batch."""
    cfg = _config(tmp_path / "out", _prompts(tmp_path), reward_funcs=[f"{__name__}:broken"])
    with pytest.raises(Exception, match=r"reward function broken raised ValueError: no answer column \(prompt "
                                        r"'Once upon a time'\)"):
        spawn(_run, 2, cfg)


@pytest.mark.parametrize("change, match", [
    (dict(grpo=dict(num_generations=3)), "grpo.num_generations 3 does not divide train.global_batch_size 16"),
    (dict(grpo=dict(max_completion_length=64)), "grpo.max_completion_length 64 leaves no room"),
    (dict(grpo=dict(reward_funcs=["nowhere:reward"])), "reward function 'nowhere:reward': cannot import"),
    (dict(grpo=dict(generation_batch_size=24)), "grpo.generation_batch_size 24 is not a multiple of "
                                                "train.global_batch_size 16"),
])
def test_bad_grpo_config_refused(tmp_path, change, match):
    cfg = _config(tmp_path / "out", _prompts(tmp_path), **change.get("grpo", {}))
    with pytest.raises(Exception, match=match) as e:
        validate(cfg, world_size=1)
    assert isinstance(e.value, ConfigError) or type(e.value).__name__ == "RewardError"
    assert not (tmp_path / "out").exists()


def _killed_in(cfg: TrainConfig, method: str, at_call: int):
    """`_run`, SIGKILLed inside the transformers engine's `at_call`-th call of `method` (`generate`: the step's weights
    pushed, no completion yet; `load_tensors`: the live weights gathered, the engine copying them in)."""
    import os
    import signal

    from hfmeg.generation.transformers_engine import TransformersEngine

    real, calls = getattr(TransformersEngine, method), []

    def killed(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    setattr(TransformersEngine, method, killed)
    _run(cfg)


@pytest.mark.parametrize("method, at_call", [("generate", 3), ("load_tensors", 2)])
def test_a_kill_during_generation_or_a_weight_push_resumes_to_the_uninterrupted_losses(tmp_path, method, at_call):
    """4 steps straight == 4 steps SIGKILLed in step 3's generation or weight push (the engine's 3rd generate, or its
    2nd load_tensors: step 1's push builds it from a folder) and resumed from step 2's checkpoint: the prompts'
    cursor and the seeds it gives regenerate the same completions from the same weights (exactly: one process, the
    same fp32 arithmetic), so rewards, losses and gradient norms are equal. The killed run's shared-memory export
    folder outlives it, and the next GRPO run (of another out) removes it as it starts."""
    from dataclasses import replace

    from hfmeg.parallel.launch import WorkerError
    from hfmeg.train.rollout import SHM, export_folder
    from hfmeg.train.rollout_folder import OWNER

    data = _prompts(tmp_path)
    cfg = _config(tmp_path / "killed", data, steps=4)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, save_every=1))
    with pytest.raises(WorkerError):
        spawn(_killed_in, 1, cfg, method, at_call)
    assert [r["step"] for r in _rows(tmp_path / "killed")] == [1, 2]
    left = export_folder(tmp_path / "killed")
    assert left.parent != SHM or (left / OWNER).is_file()  # where there is shared memory, the killed run's folder
    spawn(_run, 1, _config(tmp_path / "straight", data, steps=4))
    assert left.parent != SHM or not left.exists()
    spawn(_run, 1, replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto")))
    a, b = _rows(tmp_path / "straight"), _rows(tmp_path / "killed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for k in ("reward", "completions/mean_length", "loss", "grad_norm"):
            assert x[k] == y[k], (k, x["step"])


def _owner(folder: Path, die: bool) -> int:
    """A forked process that claims `folder` (train/rollout_folder.py) and is then SIGKILLed by itself (`die`), or
    waits to be; its pid once the claim is made."""
    import os
    import signal

    from hfmeg.train.rollout_folder import RolloutFolder

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(read)
            RolloutFolder(folder).claim()
            (folder / "hf").mkdir()
            os.write(write, b"1")
            os.kill(os.getpid(), signal.SIGKILL) if die else signal.pause()
        finally:
            os._exit(1)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    return pid


def test_the_next_run_removes_the_folders_of_killed_runs_only(tmp_path):
    """Rollout folders in a shared-memory root: one whose owner was SIGKILLed, one whose owner lives, one with no
    owner record (an older hfmeg's). A run's claim removes the first only; its release removes its own; once the
    living owner is killed too, a sweep removes its folder."""
    import os
    import signal

    from hfmeg.train.rollout_folder import RolloutFolder, sweep

    dead, live, old = (tmp_path / f"hfmeg-rollout-{name}" for name in ("dead", "live", "old"))
    pid = _owner(live, die=False)
    os.waitpid(_owner(dead, die=True), 0)  # after the living one: a claim sweeps first
    old.mkdir()
    try:
        mine = RolloutFolder(tmp_path / "hfmeg-rollout-mine")
        assert mine.claim() == [dead]
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "hfmeg-rollout-mine", old.name]
        assert sweep(tmp_path) == []  # a second run meanwhile: every owner left is alive
        mine.release()
        assert not mine.folder.exists()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert sweep(tmp_path) == [live] and [p.name for p in tmp_path.iterdir()] == [old.name]


LEARN_STEPS = 12


def check_learns_and_each_step_is_one_process(root: Path, run, cfg_of, *args) -> list[dict]:
    """A LEARN_STEPS-step TP2 x PP2 run raises the mean reward, and each of its steps is a one-process step's within
    check_layouts_agree's bounds. `run(cfg, *args)` runs a trainer; `cfg_of(out, tp, pp)` is the run's config.

    Per step, not one free one-process run beside it: two layouts' weights part by float rounding that Adam turns
    into whole-size updates wherever a gradient is rounding noise, and once they have parted far enough a seeded
    draw takes another token and the runs sample other completions (after 4-27 steps here, docs/grpo.md): no bound
    derived from one step's arithmetic holds over a few dozen. So step k runs once more in one process from the
    grid's checkpoint k - 1 (resharded to TP1: the same weights, optimizer state and prompt cursor, bit for bit), and
    must sample the same completions (its push exports the same HF tensors) and agree within one step's bounds.

    Learning: the mean reward of the last 4 steps exceeds the first 2 steps' by more than 3 standard errors of that
    difference for rewards in [0, 1] (a mean of n such rewards has a variance of at most 1 / 4n)."""
    from dataclasses import replace

    from hfmeg.commands.reshard import main as reshard

    grid = root / "grid"
    cfg = cfg_of(grid, 2, 2)
    spawn(run, 4, replace(cfg, checkpoint=replace(cfg.checkpoint, save_every=1, keep_last=LEARN_STEPS)), *args,
          timeout_s=1800)
    rows = _rows(grid)
    rewards = [r["reward"] for r in rows]
    n_first, n_last = 2 * cfg.train.global_batch_size, 4 * cfg.train.global_batch_size
    noise = 3 * (1 / (4 * n_first) + 1 / (4 * n_last)) ** 0.5
    assert sum(rewards[-4:]) / 4 - sum(rewards[:2]) / 2 > noise, rewards
    for k in range(1, LEARN_STEPS + 1):
        one = cfg_of(root / f"step{k}", 1, 1)
        if k > 1:
            mp = root / f"step{k}-from"
            assert reshard(["--mp", str(grid / "checkpoints"), "--iteration", str(k - 1), "--out", str(mp),
                            "--tp", "1", "--pp", "1"]) == 0
            one = replace(one, checkpoint=replace(one.checkpoint, resume=str(next(mp.glob("iter_*")))))
        spawn(run, 1, replace(one, train=replace(one.train, max_steps=k)), *args, timeout_s=600)
        check_layouts_agree(_rows(root / f"step{k}")[-1:], rows[k - 1:k], 1)
    return rows


def test_grpo_learns_at_tp2_pp2_each_step_as_one_process(tmp_path):
    """The park reward at lr 2e-3 (docs/grpo.md's run, shorter), the transformers engine."""
    from dataclasses import replace

    data = _prompts(tmp_path)

    def cfg_of(out, tp, pp):
        cfg = _config(out, data, tp=tp, pp=pp, steps=LEARN_STEPS)
        return replace(cfg, optim=replace(cfg.optim, lr=2e-3), lr=replace(cfg.lr, decay="constant"))

    check_learns_and_each_step_is_one_process(tmp_path, _run, cfg_of)
