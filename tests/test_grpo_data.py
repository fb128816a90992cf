"""Online RL's data: prompts read from a dataset, completions packed as `CompletionBatch`es, rewards scored and
turned into advantages; each bad input one typed error naming what is wrong."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import stories_or_skip

from hfmeg.data.config import SourceConfig
from hfmeg.data.prompts import PromptReader
from hfmeg.data.rollouts import Completion, pack_completions
from hfmeg.errors import DataError, LayoutError
from hfmeg.train.dataclass_io import ConfigError
from hfmeg.train.grpo import GRPOSettings, group_advantages
from hfmeg.train.rewards import RewardError, accuracy, final_answer, resolve, score, think_format


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_or_skip())


def test_prompts_resume_and_cycle(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(dict(prompt=f"Once upon a time {i}", solution=str(i))) + "\n" for i in range(3)))
    tok = _tokenizer()
    reader = PromptReader(SourceConfig(str(path)), tok, 64)
    first = reader.take(4)  # three records, then the second epoch's first
    assert [p.index for p in first] == [0, 1, 2, 0] and reader.cursor == (1, 1)
    assert [p.epoch for p in first] == [0, 0, 0, 1]
    assert first[1].ids == tok("Once upon a time 1").input_ids and first[1].columns == {"solution": "1"}
    resumed = PromptReader(SourceConfig(str(path)), tok, 64, cursor=(0, 2))
    assert [p.index for p in resumed.take(2)] == [2, 0]


def test_eval_prompts_are_held_out_of_training(tmp_path):
    from hfmeg.data import DataConfig
    from hfmeg.data.prompts import eval_prompts

    path, other = tmp_path / "p.jsonl", tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(dict(prompt=f"Once upon a time {i}", solution=str(i))) + "\n" for i in range(6)))
    other.write_text("".join(json.dumps(dict(prompt=f"The cat {i}")) + "\n" for i in range(3)))
    tok = _tokenizer()
    cfg = DataConfig(sources=[SourceConfig(str(path))], eval_split=2, seq_len=64)
    held = eval_prompts(cfg, tok, 64)
    trained = PromptReader(SourceConfig(str(path)), tok, 64, eval_split=2).take(4)
    assert len(held) == 2 and sorted(p.text for p in held + trained) == [f"Once upon a time {i}" for i in range(6)]
    assert held[0].columns == {"solution": held[0].text.split()[-1]}
    cfg = DataConfig(sources=[SourceConfig(str(path))], eval_sources=[SourceConfig(str(other))], seq_len=64)
    assert [p.text for p in eval_prompts(cfg, tok, 64)] == [f"The cat {i}" for i in range(3)]


def test_prompt_errors(tmp_path):
    tok = _tokenizer()
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(dict(question="no prompt")) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: no 'prompt' column"):
        PromptReader(SourceConfig(str(path)), tok, 64).take(1)
    path.write_text(json.dumps(dict(prompt="Once upon a time there was a very long prompt")) + "\n")
    with pytest.raises(DataError, match="more than the 3"):
        PromptReader(SourceConfig(str(path)), tok, 3).take(1)


def test_pack_completions_layout():
    cs = [Completion([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3]), Completion([1], [6], [-0.4]),
          Completion([7, 8], [9], [-0.5]), Completion([7], [2, 3], [-0.6, -0.7])]
    mbs = pack_completions(cs, torch.tensor([1.0, -1.0, 0.5, -0.5]), per_row=2, seq_len=8, pad_id=0, rows=2)
    (mb,) = mbs
    assert mb.num_completions == 4 and mb.shape == (2, 8)
    # row 0: [1 2 3 4 5 | 1 6 | pad]; labels predict each completion token from the one before it
    assert mb.labels[0].tolist() == [-100, 3, 4, 5, -100, 6, -100, -100]
    assert mb.sequence_ids[0].tolist() == [-1, 0, 0, 0, -1, 1, -1, -1]
    assert mb.sequence_ids[1].tolist() == [-1, 2, -1, 3, 3, -1, -1, -1]
    assert mb.gen_logps[1].tolist() == pytest.approx([0, -0.5, 0, -0.6, -0.7, 0, 0, 0])
    masked = pack_completions(cs, torch.zeros(4), 2, 8, 0, rows=2, masked=[False, True, False, False])[0]
    assert masked.sequence_ids[0].tolist() == [-1, 0, 0, 0, -1, -1, -1, -1] and masked.num_completions == 4
    with pytest.raises(LayoutError, match="do not fit a row of data.seq_len 6"):
        pack_completions(cs, torch.zeros(4), 2, 6, 0)


def test_rewards():
    assert final_answer("so it is 1,234.") == "1234" and final_answer("x\n#### 42") == "42"
    assert accuracy(["q", "q"], ["the answer is 7", "8"], solution=["#### 7", "7"]) == [1.0, 0.0]
    assert accuracy(["q"], [[{"role": "assistant", "content": "7"}]], answer=["7"]) == [1.0]
    assert accuracy(["q"], ["7"]) == [None]
    assert think_format(["q", "q"], ["<think>\nhm\n</think>\n<answer>\n7\n</answer>", "7"]) == [1.0, 0.0]
    assert resolve("accuracy") is accuracy and resolve("math:sqrt") is math.sqrt and resolve("math.floor") is math.floor
    with pytest.raises(RewardError, match="'nope.missing': cannot import"):
        resolve("nope.missing")
    rewards = score([accuracy, think_format], ["q", "q"], ["7", "x"], {"solution": ["7", None]})
    assert rewards[:, 0].tolist()[0] == 1.0 and math.isnan(rewards[1, 0]) and rewards[:, 1].tolist() == [0, 0]

    def short(prompts, completions, **kw):
        return [1.0]

    def boom(prompts, completions, **kw):
        raise KeyError("answer")

    def nan(prompts, completions, **kw):
        return [math.nan] * len(completions)

    for f, match in ((short, "short returned 1 rewards for 2 completions"), (boom, "boom raised KeyError"),
                     (nan, "nan returned nan")):
        with pytest.raises(RewardError, match=match):
            score([f], ["q", "q"], ["a", "b"], {})


def test_advantages_as_trl_defines_them():
    """Hand-computed groups: mean-centred, divided by the Bessel std + 1e-4; a None left out; zero-std groups."""
    cfg = GRPOSettings(num_generations=2)
    rewards = torch.tensor([[1.0, math.nan], [0.0, 1.0], [2.0, math.nan], [2.0, math.nan]])
    adv, metrics = group_advantages(rewards, torch.tensor([1.0, 0.5]), cfg, ["a", "b"])
    # totals 1, 0.5 (group std sqrt(0.125)), 2, 2 (std 0)
    s = math.sqrt(0.125)
    assert adv.tolist() == pytest.approx([0.25 / (s + 1e-4), -0.25 / (s + 1e-4), 0, 0])
    assert metrics["frac_reward_zero_std"] == 0.5 and metrics["reward"] == pytest.approx(5.5 / 4)
    assert metrics["rewards/b/mean"] == 1.0
    none = group_advantages(rewards, torch.tensor([1.0, 0.5]), GRPOSettings(num_generations=2, scale_rewards="none"),
                            ["a", "b"])[0]
    assert none.tolist() == pytest.approx([0.25, -0.25, 0, 0])
    with pytest.raises(LayoutError, match="not whole groups"):
        group_advantages(rewards[:3], torch.ones(2), cfg, ["a", "b"])


@pytest.mark.parametrize("bad, match", [(dict(loss_type="sapo"), "grpo.loss_type"),
                                        (dict(num_generations=1), "num_generations must be >= 2"),
                                        (dict(delta=0.0), "grpo.delta must be > 0"),
                                        (dict(temperature=0.0), "grpo.temperature must be > 0"),
                                        (dict(top_p=0.0), "grpo.top_p in"),
                                        (dict(generator="sglang"), "grpo.generator must be transformers or vllm"),
                                        (dict(generation_batch_size=32, steps_per_generation=2), "set one of them"),
                                        (dict(steps_per_generation=0), "must be >= 1"),
                                        (dict(vllm_gpu_memory_utilization=1.5),
                                         r"grpo.vllm_gpu_memory_utilization must be in \(0, 1\]")])
def test_settings_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        GRPOSettings(**bad)
