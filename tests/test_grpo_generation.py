"""The transformers generation engine: greedy completions equal transformers' `generate`, sampling is seeded per
completion, a weight load takes effect, and the engine's log-probabilities of sampled tokens equal hfmeg's training
forward at TP2 x PP2 (the train/generation mismatch metric), at temperature 1 and below it. `train_logps` serves
test_vllm_engine.py too.

Bound: both sides compute each token's log-softmax from logits within TOL of transformers' full forward (the
logits' rounding bound on these sequences, derived from a float64 run: test_dpo_parity._logit_bound) (the engine's cached incremental forward is transformers' own), so each log-probability is
within 2 TOL of the other side's; both divide the logits by a temperature T before their log-softmax, so 2 TOL / T.
"""

from __future__ import annotations

import pytest
import torch
from bounds import within
from helpers import make_ps, stories_or_skip
from test_dpo_parity import _logit_bound

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.rollouts import pack_completions
from hfmeg.errors import EngineError
from hfmeg.generation.engine import SamplingParams
from hfmeg.generation.transformers_engine import TransformersEngine
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.train.grpo import MISMATCH, GRPOLoss, GRPOSettings, annotate_logps, set_temperature

PROMPTS = ["Once upon a time", "Lily liked to"]


def _setup():
    from transformers import AutoTokenizer

    folder = stories_or_skip()
    tok = AutoTokenizer.from_pretrained(folder)
    return folder, tok, [tok(p).input_ids for p in PROMPTS]


def _hf_greedy(folder, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_generate_and_load_takes_effect(tmp_path):
    from transformers import AutoModelForCausalLM

    folder, tok, prompts = _setup()
    engine = TransformersEngine(folder, [tok.eos_token_id], tok.eos_token_id)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    for c, p in zip(engine.generate(prompts, greedy, [0, 0]), prompts):
        want = _hf_greedy(folder, p, 12)
        assert c.completion_ids == want[:len(c.completion_ids)] and len(c.logps) == len(c.completion_ids)
    moved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for w in moved.parameters():
            w.add_(0.5 * w.std() * torch.randn_like(w))
    moved.save_pretrained(tmp_path / "moved")
    tok.save_pretrained(tmp_path / "moved")
    before = engine.generate(prompts, greedy, [0, 0])
    engine.load(tmp_path / "moved")
    after = engine.generate(prompts, greedy, [0, 0])
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]
    for c, p in zip(after, prompts):
        assert c.completion_ids == _hf_greedy(tmp_path / "moved", p, 12)[:len(c.completion_ids)]

    # a reload copies tensors into the built model: a folder whose weights do not fit it is refused by name
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "moved" / "model.safetensors")
    state["model.extra.weight"] = state.pop(next(k for k in state if k.endswith("q_proj.weight")))
    save_file(state, tmp_path / "moved" / "model.safetensors")
    with pytest.raises(EngineError, match="model.extra.weight"):
        engine.load(tmp_path / "moved")


def test_a_load_takes_effect_where_transformers_converts_the_stored_weights(tmp_path):
    """A Mixtral's stored per-expert matrices are not its transformers model's fused tensors: the engine builds the
    model again from each pushed folder, and generates the new weights' completions."""
    from tiny_models import save_tiny

    prompts = [[1, 5, 9, 3], [1, 7]]
    first, moved = save_tiny("mixtral", tmp_path / "a", seed=0), save_tiny("mixtral", tmp_path / "b", seed=1)
    engine = TransformersEngine(first, [0], 0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    before = engine.generate(prompts, greedy, [0, 0])
    engine.load(moved)
    after = engine.generate(prompts, greedy, [0, 0])
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]
    for c, p in zip(after, prompts):
        assert c.completion_ids == _hf_greedy(moved, p, 8)[:len(c.completion_ids)]


def test_sampling_is_seeded_per_completion():
    folder, tok, prompts = _setup()
    engine = TransformersEngine(folder, [tok.eos_token_id], tok.eos_token_id)
    params = SamplingParams(max_new_tokens=10, top_k=50, top_p=0.95)
    batch = engine.generate([prompts[0], prompts[0], prompts[1]], params, [1, 2, 3])
    alone = engine.generate([prompts[0]], params, [2])[0]
    assert alone.completion_ids == batch[1].completion_ids
    # batches of 2 and of 1 round the matmuls differently: each within the logit bound of transformers' forward
    tol = _logit_bound(folder, folder, None, [(c.prompt_ids + c.completion_ids, None) for c in batch])
    within(max(abs(a - b) for a, b in zip(alone.logps, batch[1].logps)), 4 * tol, "engine logp batch of 1 vs 2")
    assert batch[0].completion_ids != batch[1].completion_ids


def train_logps(folder, runs, pad_id):
    """Per (completions, temperature) of `runs`: the training forward's log-probability minus the generator's, per
    completion token, and the mismatch metric, at TP2 x PP2 (last stage; None elsewhere)."""
    ps = make_ps(tp=2, pp=2)
    chunks = load_chunks(HFCheckpoint(folder), ps)
    out = []
    for completions, temperature in runs:
        set_temperature(chunks, temperature)
        mbs = pack_completions(completions, torch.zeros(len(completions)), 2, 64, pad_id)
        annotated = annotate_logps(chunks, mbs, ps, "1f1b", "old_logps")
        loss = GRPOLoss(GRPOSettings(num_generations=2, temperature=temperature), ps, len(completions), 1)
        forward_backward(chunks, ps, mbs, schedule="1f1b", loss=loss, forward_only=True)
        if ps.is_last_stage:
            diffs = torch.cat([(mb.old_logps - mb.gen_logps)[mb.sequence_ids >= 0] for mb in annotated])
            out.append((diffs, loss.metrics(loss.totals)))
    return out if ps.is_last_stage else None


def test_generator_logps_equal_training_forward_tp2_pp2():
    """At temperature 1 and 0.7 (both sides score softmax(logits / T): within 2 TOL / T)."""
    folder, tok, prompts = _setup()
    engine = TransformersEngine(folder, [tok.eos_token_id], tok.eos_token_id)
    runs = [(engine.generate([prompts[0]] * 2 + [prompts[1]] * 2, SamplingParams(max_new_tokens=16, temperature=t),
                             [5, 6, 7, 8]), t) for t in (1.0, 0.7)]
    results = [r for r in spawn(train_logps, 4, str(folder), runs, tok.eos_token_id) if r is not None]
    tol = _logit_bound(folder, folder, None, [(c.prompt_ids + c.completion_ids, None) for cs, _ in runs for c in cs])
    assert results
    for rank in results:
        for (diffs, metrics), (completions, t) in zip(rank, runs, strict=True):
            assert len(diffs) == sum(len(c.completion_ids) for c in completions)
            within(float(diffs.abs().max()), 2 * tol / t, "generator logp vs training forward", f"tp2 pp2 T={t}")
            assert metrics[MISMATCH] == pytest.approx(float(diffs.abs().mean()), rel=1e-5)  # the same float32 terms
