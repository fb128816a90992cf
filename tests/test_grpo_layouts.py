"""GRPO end to end under context and expert parallelism: each run equals a one-process run, step by step.

Three steps each, the transformers engine, against the one-process run of the same config: CP2, CP2 x TP2
(sequence parallel) and CP2 x PP2 on stories260K with the park reward (test_grpo_train.py's run), and EP2 (DP 2)
and EP2 x CP2 on a tiny random Mixtral (with `steps_per_generation` 2, below, too) with stories260K's tokenizer, whose random completions are scored by a reward on their text that
varies within a group. Every step samples the same completions (equal rewards: the engine runs on rank 0 from the
exported weights, which agree up to the layouts' rounding) and its loss and gradient norm are within
test_grpo_train.check_layouts_agree's bounds (derived there: on-policy DAPO's loss is a float32 sum of −A_i n_i / T,
the gradient norm within the suite's layout bound); the train/generation mismatch within 2 TOL.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

from helpers import stories_or_skip
from test_grpo_train import (EPS, _config, _expected_steps, _generation_config, _prompts, _rows, _run, _run_scripted,
                             check_layouts_agree)
from tiny_models import save_tiny

from hfmeg.parallel.launch import spawn

STEPS = 3


def vowels(prompts, completions, **kwargs):
    """The share of a completion's characters that are vowels: random tokens give every completion another one."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def _with_parallel(cfg, **parallel):
    return replace(cfg, parallel=replace(cfg.parallel, **parallel))


def test_grpo_under_context_parallelism_matches_one_process(tmp_path):
    data = _prompts(tmp_path)
    spawn(_run, 1, _config(tmp_path / "single", data, steps=STEPS))
    spawn(_run, 2, _with_parallel(_config(tmp_path / "cp2", data, steps=STEPS), cp=2))
    spawn(_run, 4, _with_parallel(_config(tmp_path / "cp2tp2", data, tp=2, steps=STEPS), cp=2,
                                  sequence_parallel=True))
    spawn(_run, 4, _with_parallel(_config(tmp_path / "cp2pp2", data, pp=2, steps=STEPS), cp=2))
    single = _rows(tmp_path / "single")
    for name in ("cp2", "cp2tp2", "cp2pp2"):
        check_layouts_agree(single, _rows(tmp_path / name), STEPS)


def _mixtral(tmp_path):
    stories = stories_or_skip()
    model = save_tiny("mixtral", tmp_path / "mixtral", vocab_size=512, output_router_logits=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    return model


def test_grpo_under_expert_parallelism_matches_one_process(tmp_path):
    data, model = _prompts(tmp_path), _mixtral(tmp_path)

    def cfg(out, **parallel):
        c = _config(out, data, steps=STEPS, reward_funcs=[f"{__name__}:vowels"])
        return _with_parallel(replace(c, model=replace(c.model, path=str(model))), **parallel)

    spawn(_run, 1, cfg(tmp_path / "single"))
    spawn(_run, 2, cfg(tmp_path / "ep2", ep=2))
    spawn(_run, 4, cfg(tmp_path / "ep2cp2", ep=2, cp=2))
    single = _rows(tmp_path / "single")
    for name in ("ep2", "ep2cp2"):
        rows = _rows(tmp_path / name)
        check_layouts_agree(single, rows, STEPS)
        assert all(r["reward_std"] > 0 for r in rows)  # the reward separates completions: a gradient to compare
        assert all("expert_load" in r for r in rows)


def test_generation_running_ahead_at_dp2_x_pp2_matches_one_process(tmp_path):
    """steps_per_generation 2 (test_grpo_train.py's scripted engine and generation config) at DP2 x PP2: each DP rank
    trains its share of each step's half of the generation batch, π_old from the pipeline's forward-only pass. Every
    step has the one-process run's token count and reward; the first step of each generation its on-policy loss
    (within the float32 rounding bound of test_grpo_train.py's check); every step's gradient norm within the suite's
    layout bound EPS relative."""
    from bounds import rounding_bound, within

    data = _prompts(tmp_path)
    single_cfg = _generation_config(tmp_path / "single", data, 4)
    spawn(_run_scripted, 1, single_cfg)
    grid_cfg = _with_parallel(_generation_config(tmp_path / "grid", data, 4), pp=2)
    spawn(_run_scripted, 4, replace(grid_cfg, checkpoint=replace(grid_cfg.checkpoint, save_every=3)))
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "grid")
    expected = _expected_steps(single_cfg, 2)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b] == [e[0] for e in expected]
    for step, (x, y, (_, loss32, loss64, _)) in enumerate(zip(a, b, expected), 1):
        assert x["reward"] == y["reward"]
        if step in (1, 3):
            within(abs(y["loss"] - loss64), rounding_bound(loss32, loss64), "grpo generation ahead dp2pp2 on-policy",
                   step)
        within(abs(x["grad_norm"] - y["grad_norm"]), EPS * x["grad_norm"], "grpo generation ahead grad norm", step)
    # Step 3's checkpoint falls inside the second generation batch: it keeps the batch and the grid's π_old. Resharded
    # to TP1 x PP1, a resume in one process (DP1) and at CP2 (the π_old of each CP rank's tokens looked up by position)
    # trains step 4 on them: no push, no generation, the grid's tokens and reward, its gradient norm within the layout
    # bound (the same weights, optimizer state and π_old, another layout's arithmetic).
    from hfmeg.commands.reshard import main as reshard

    mp = tmp_path / "step4-from"
    assert reshard(["--mp", str(tmp_path / "grid" / "checkpoints"), "--iteration", "3", "--out", str(mp), "--tp", "1",
                    "--pp", "1"]) == 0
    held = next(mp.glob("iter_*"))
    assert (held / "rollout" / "generation.safetensors").is_file()
    for name, ranks, cp in (("step4", 1, 1), ("step4-cp2", 2, 2)):
        one = _with_parallel(_generation_config(tmp_path / name, data, 4), cp=cp)
        calls = spawn(_run_scripted, ranks, replace(one, checkpoint=replace(one.checkpoint, resume=str(held))))
        assert calls == [[]] * ranks  # no push, no generation: step 4 trains on the kept batch
        (x,), y = _rows(tmp_path / name), b[3]
        assert x["step"] == 4 and x["tokens"] == y["tokens"] and x["reward"] == y["reward"]
        within(abs(x["grad_norm"] - y["grad_norm"]), EPS * y["grad_norm"], f"grpo resumed inside a generation batch "
               f"({name})", 4)
