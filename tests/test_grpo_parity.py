"""GRPO, DAPO, Dr. GRPO, BNPO and GSPO on the TP x PP x CP layers vs TRL's GRPOTrainer on the same completions (fp32).

TRL is handed fixed completions through its `rollout_func` (3 prompts x 4 generations of stories260K
text), scores them with a fixed reward function (one None among them), and computes its advantages,
its reference log-probabilities and, from its own forward, its loss and metrics (`_compute_loss`, the
body of `compute_loss`). The old log-probabilities (π_old, as `num_iterations` > 1 has them) are TRL's
policy log-probabilities moved by fixed noise, given to both sides, so the importance weights spread
over the clip range. hfmeg computes the advantages from the same rewards (`group_advantages`), packs
the same token ids two completions to a row (`pack_completions`), runs the reference forward-only pass
and the policy's forward and backward at TP in {1, 2} x PP in {1, 2} and CP 2, in one 4-process gloo
world (DP fills the rest, every replica runs the same completions), full and LoRA. Beside the loss and
metrics, the loss's gradient in each token's log-probability (∂loss/∂π, what the backward carries into
the head; the layers' gradients from it are the DPO tests' machinery) is compared token by token. One case is a
generation batch feeding 3 steps (`steps_per_generation` 3): TRL's loss of its second buffered slice (advantages
over the whole batch, DAPO normalised by the batch's tokens / 3) against hfmeg's on the same 4 completions. The policy is stories260K moved off the reference, or a random LoRA adapter on it (the
reference is the base with the adapter off), so the KL is far from 0.

Bounds: each log-probability is within 2 TOL of transformers' (the logits' rounding bound derived from float64 runs,
as in test_dpo_parity.py; 2
TOL / τ at a sampling temperature τ, both sides dividing the logits by it), the policy's and the reference's alike,
so a log-ratio is within 4 TOL (a GSPO mean of them too). A token's loss moves with them at most at rate g_t = |A|
w + β w (|e^d − 1| + k3) (d = ρ − π, w the importance weight), so every aggregate (a mean or a sum over N × L of
them) is within 4 TOL Σ_t s_t g_t, s_t the token's share of the aggregate (1/(n_i N), 1/T, 1/(N L)), × c = max(1.01,
e^{4 TOL}) for the exponential's curvature over the step; the `kl` metric within 4 TOL mean_t w (|e^d − 1| + k3) × c;
∂loss/∂π of a token (token level) within 4 TOL × c s_t (|A| w + β w (|e^d − 1| + k3 + 2 e^d + 1)), its own
derivative's bound. A clip indicator may flip only for a weight within its bound of a clip edge; the ratios' bound
counts those tokens. The advantages are TRL's float32 arithmetic on the same numbers (bound: a few float32 ulps of
their size).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
from bounds import within
from helpers import make_ps, stories_or_skip
from peft_helpers import hfmeg_chunks
from test_dpo_parity import _logit_bound, _policy_and_reference, _trl_models

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.rollouts import Completion, pack_completions, token_values
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.peft.adapters import adapters_off
from hfmeg.train.grpo import ENTROPY, METRICS, GRPOLoss, GRPOSettings, annotate_logps, group_advantages, set_temperature

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]  # tp, pp, cp
SEQ_LEN = 48
G = 4
PROMPTS = ["Once upon a time", "Lily liked", "The sun was"]
COMPLETIONS = [" there was a cat.", " a big dog", " the end", " she ran and ran to the park.",
               " to play with her ball.", " apples", " red", " the cat and the dog.",
               " warm.", " a big yellow ball in the sky.", " hot", " up"]
REWARDS = [1.0, 0.0, 0.5, 1.0, None, 0.25, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # the last group: zero std
MAX_COMPLETION_LENGTH = 16

CASES = [dict(loss_type="grpo", beta=0.04),
         dict(loss_type="bnpo", beta=0.0, scale_rewards="none"),
         dict(loss_type="dr_grpo", beta=0.04, scale_rewards="batch"),
         dict(loss_type="dapo", beta=0.04, epsilon_high=0.28, delta=1.5),
         dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"),
         dict(loss_type="dapo", beta=0.0, on_policy=True),
         dict(loss_type="grpo", beta=0.04, temperature=0.7),  # both sides score softmax(logits / T)
         # one generation batch (the 12 completions) feeding 3 steps: the second step's share, TRL's buffered slice
         dict(loss_type="dapo", beta=0.04, steps_per_generation=3, part=1)]


def _reward(prompts, completions, **kwargs):
    return REWARDS[:len(completions)]


def _token_ids(tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS for _ in range(G)]
    completions = [tokenizer(c, add_special_tokens=False).input_ids for c in COMPLETIONS]
    return prompts, completions


def _trl_grpo(policy, reference, adapter, case: dict, out, tokenizer_path):
    """TRL's GRPOTrainer on the fixed completions: its inputs (advantages, old and reference log-probabilities,
    masks), loss, metrics, per-token log-probabilities and the loss's gradient in each of them."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.pad_token = tokenizer.eos_token
    prompt_ids, completion_ids = _token_ids(tokenizer)
    settings = {k: v for k, v in case.items() if k not in ("on_policy", "part")}
    steps = case.get("steps_per_generation", 1)
    args = GRPOConfig(output_dir=str(out), report_to="none", use_cpu=True, bf16=False, num_generations=G,
                      per_device_train_batch_size=G * len(PROMPTS) // steps,
                      max_completion_length=MAX_COMPLETION_LENGTH, **settings)
    model, _ = _trl_models(policy, reference, adapter)

    def rollout(prompts, trainer):
        return dict(prompt_ids=prompt_ids, completion_ids=completion_ids, logprobs=None)

    trainer = GRPOTrainer(model=model, reward_funcs=[_reward], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([dict(prompt=p) for p in PROMPTS]), rollout_func=rollout)
    if adapter is not None and "ref" in trainer.model.peft_config:
        trainer.model.delete_adapter("ref")  # hfmeg's reference for a fresh adapter: the base, adapters off
    if adapter is None and case["beta"]:
        trainer.ref_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
        from trl.trainer.utils import add_fused_lm_head  # as the trainer prepares its own reference
        add_fused_lm_head(trainer.ref_model, temperature=args.temperature, cast_lm_head_to_fp32=False)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets: one micro-batch a step
    inputs = trainer._generate_and_score_completions([dict(prompt=p) for p in PROMPTS for _ in range(G)])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, ids.shape[1] - inputs[
            "prompt_ids"].shape[1])[0]
    if not case.get("on_policy"):
        noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
        inputs["old_per_token_logps"] = logps + 0.3 * noise
    if "part" in case:  # the step's share of the generation batch, as TRL's `_prepare_inputs` buffers it
        from trl.trainer.utils import split_tensor_dict

        inputs = split_tensor_dict(inputs, steps)[case["part"]]
        logps = logps.chunk(steps)[case["part"]]
    forward = trainer._get_per_token_logps_and_entropies
    kept = []

    def keep_logps(*args, **kwargs):  # the loss's own log-probabilities, whose gradient is ∂loss/∂π per token
        out = forward(*args, **kwargs)
        out[0].retain_grad()
        kept.append(out[0])
        return out

    trainer._get_per_token_logps_and_entropies = keep_logps
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    token_grads = _per_completion(kept[0].grad, inputs["completion_mask"])
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return inputs, loss.item(), metrics, logps, token_grads


def _per_completion(t: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m.bool()].tolist() for row, m in zip(t, mask)]


class _KeepTokenGrads(GRPOLoss):
    """The loss, keeping ∂loss/∂π of every completion token (π = −per-token loss), per completion in order."""

    def __call__(self, per_token, mb):
        held = self.__dict__.setdefault("held", [])
        held.append(None)
        index = len(held) - 1  # micro-batch order, whatever order the backward runs them in

        def keep(g):
            held[index] = (mb.sequence_ids, -g)

        per_token.register_hook(keep)
        return super().__call__(per_token, mb)

    def token_grads(self) -> list[list[float]]:
        return [g[ids == k].tolist() for ids, g in self.held for k in range(int(ids.max()) + 1)]


def _run_layouts(policy, reference, adapter, runs, pad_id: int):
    """Each case of `runs` (settings, completions, advantages, old log-probabilities or None) at each layout: loss,
    metrics and (CP 1) ∂loss/∂π per completion token. The DP copies of a layout (dp_rank > 0, every replica given
    the same completions) would repeat copy 0's work exactly: they only create the layout's groups."""
    rows = []
    for tp, pp, cp in LAYOUTS:
        ps = make_ps(tp=tp, pp=pp, cp=cp)
        if ps.dp_rank > 0:
            continue
        if adapter is not None:
            chunks, _ = hfmeg_chunks(policy, adapter, ps)
            ref_chunks, switched = chunks, (lambda: adapters_off(chunks))
        else:
            chunks = load_chunks(HFCheckpoint(policy), ps)
            ref_chunks, switched = load_chunks(HFCheckpoint(reference), ps), None
        for i, (settings, completions, advantages, old, dapo_tokens) in enumerate(runs):
            cfg = GRPOSettings(**settings)
            set_temperature(chunks, cfg.temperature)
            set_temperature(ref_chunks, cfg.temperature)
            mbs = pack_completions(completions, advantages, 2, SEQ_LEN, pad_id)
            if old is not None:
                mbs = [replace(mb, old_logps=token_values(mb, old[2 * k:2 * k + 2])) for k, mb in enumerate(mbs)]
            mbs = [mb.shard(ps.cp_rank, cp) for mb in mbs]
            if cfg.needs_reference:
                kw = {} if switched is None else dict(switched=switched)
                mbs = annotate_logps(ref_chunks, mbs, ps, "1f1b", "ref_logps", **kw)
            tokens = sum(len(c.completion_ids) for c in completions)
            objective = _KeepTokenGrads(cfg, ps, len(completions), tokens, chunks, dapo_tokens)
            loss = forward_backward(chunks, ps, mbs, schedule="1f1b", loss=objective)
            if cp > 1 and loss is not None:  # each CP rank holds its share of the loss
                t = torch.tensor(loss)
                torch.distributed.all_reduce(t, group=ps.cp_group)
                loss = t.item()
            token_grads = objective.token_grads() if ps.is_last_stage and cp == 1 else None
            rows.append(dict(case=i, layout=(tp, pp, cp), loss=loss, token_grads=token_grads,
                             metrics=objective.metrics(objective.totals) if ps.is_last_stage else None))
    return rows


def _bounds(inputs, logps, case, tol: float):
    """From TRL's own numbers, float64 (module doc): the loss's bound, the kl metric's, the count of tokens whose
    weight is within its bound of a clip edge, and each completion token's bound on ∂loss/∂π (token level)."""
    mask = inputs["completion_mask"].bool()
    pi = logps.double()
    old = inputs.get("old_per_token_logps", logps).double()
    adv = inputs["advantages"].double()[:, None].expand_as(pi)
    ratio = pi - old
    if case.get("importance_sampling_level") == "sequence":
        ratio = ((ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(pi)
    w = ratio.exp()
    g = adv.abs() * w  # the rate at which a token's loss moves with π
    h = adv.abs() * w  # the rate at which its derivative does
    kl_rate = torch.zeros_like(w)
    if case["beta"]:
        d = inputs["ref_per_token_logps"].double() - pi
        k3 = d.exp() - d - 1
        kl_rate = w * ((d.exp() - 1).abs() + k3)
        g = g + case["beta"] * kl_rate
        h = h + case["beta"] * w * ((d.exp() - 1).abs() + k3 + 2 * d.exp() + 1)
    n, tokens = mask.sum(-1, keepdim=True).double(), mask.sum().double()
    normaliser = _dapo_tokens(inputs, case) or float(tokens)
    weight = {"grpo": 1 / (n * len(n)), "dr_grpo": torch.full_like(n, 1 / (len(n) * MAX_COMPLETION_LENGTH))}.get(
        case["loss_type"], torch.full_like(n, 1 / normaliser)).expand_as(pi)  # each token's share of the loss
    step = 4 * tol / case.get("temperature", 1.0)  # logits / T: their bound too
    step *= max(1.01, math.exp(step))  # the exponential's curvature over the step
    eps_high = case.get("epsilon_high") or 0.2
    edges = torch.tensor([1 - 0.2, 1 + eps_high])
    near = ((w[..., None] - edges).abs() <= 2 * step * w[..., None]).any(-1) & mask
    return (step * float((g * weight)[mask].sum()), step * float(kl_rate[mask].sum() / tokens), int(near.sum()),
            _per_completion(step * h * weight, mask))


def _dapo_tokens(inputs, case) -> float | None:
    """DAPO's normaliser where a generation batch feeds several steps: its tokens / the steps (TRL's
    `num_items_in_batch`, gradient_accumulation_steps 1, over steps_per_generation)."""
    steps = case.get("steps_per_generation", 1)
    return float(inputs["num_items_in_batch"]) / steps if steps > 1 else None


def _check(policy, reference, adapter, root):
    tokenizer = stories_or_skip()
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(tokenizer).eos_token_id
    runs, wants = [], []
    for i, case in enumerate(CASES):
        inputs, want_loss, want, logps, want_token_grads = _trl_grpo(policy, reference, adapter, case, root / f"trl{i}",
                                                               tokenizer)
        settings = {k: v for k, v in case.items() if k not in ("on_policy", "part")}
        cfg = GRPOSettings(num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH, **settings)
        rewards = torch.tensor([[math.nan if r is None else r] for r in REWARDS], dtype=torch.float32)
        advantages, reward_metrics = group_advantages(rewards, torch.ones(1), cfg, ["_reward"])  # whole batch
        if "part" in case:
            advantages = advantages.chunk(cfg.steps_per_generation)[case["part"]]
        scale = float(inputs["advantages"].abs().max())
        within(float((advantages - inputs["advantages"]).abs().max()), 8 * 1.2e-7 * max(scale, 1),
               "grpo advantages vs trl", case)
        for k, v in reward_metrics.items():
            within(abs(v - want[k]), 1e-6 * max(abs(want[k]), 1), f"{k} vs trl", case)
        prompt_ids = [row[m.bool()].tolist() for row, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
        completions = [Completion(p, c) for p, c in zip(prompt_ids, _per_completion(inputs["completion_ids"],
                                                                                      inputs["completion_mask"]))]
        old = inputs.get("old_per_token_logps")
        runs.append((dict(cfg.__dict__), completions, advantages,
                     None if old is None else _per_completion(old, inputs["completion_mask"]),
                     _dapo_tokens(inputs, case)))
        if i == 0:  # TOL, derived: the logits' rounding on these sequences (test_dpo_parity._logit_bound), every case's
            tol = _logit_bound(policy, reference, adapter, [(c.prompt_ids + c.completion_ids, None) for c in completions])
        wants.append((want_loss, want, want_token_grads, _bounds(inputs, logps, case, tol)))
        if case["beta"]:
            assert want["kl"] > 1e-3, "the policy must be far from its reference for the KL to bite"
    assert max(w[1]["clip_ratio/region_mean"] for w in wants) > 0.05, "some weights must be clipped"
    results = spawn(_run_layouts, 4, str(policy), str(reference), adapter and str(adapter), runs, pad_id)
    for i, (want_loss, want, want_token_grads, (loss_bound, kl_bound, near, token_bounds)) in enumerate(
            wants):
        case = CASES[i]
        # Entropy: its derivative in a logit is -p_v (log p_v + H), so logits within TOL / τ of transformers' move a
        # token's H by at most TOL / τ Σ_v p_v |log p_v + H| <= 2 H TOL / τ, a mean of them by 2 TOL / τ of the mean
        # (× max(1.01, e^{4 TOL / τ}) for the curvature), plus TRL's own fp32 mean (a few ulps).
        step = 4 * tol / case.get("temperature", 1.0)
        entropy_bound = step / 2 * max(1.01, math.exp(step)) + 4.8e-7
        for layout in LAYOUTS:
            rows = [r for rank in results for r in rank if r["layout"] == layout and r["case"] == i]
            assert any(r["loss"] is not None for r in rows)
            for r in rows:
                where = (case, layout)
                if r["loss"] is not None:
                    within(abs(r["loss"] - want_loss), loss_bound, "grpo loss vs trl", where)
                    got = r["metrics"]
                    assert set(got) == {k for k in METRICS if k != "kl" or case["beta"]} | {ENTROPY}
                    within(abs(got[ENTROPY] - want[ENTROPY]), entropy_bound * want[ENTROPY], "grpo entropy vs trl",
                           where)
                    if case["beta"]:
                        within(abs(got["kl"] - want["kl"]), kl_bound, "grpo kl vs trl", where)
                    den = sum(len(c.completion_ids) for c in runs[i][1])
                    if case.get("importance_sampling_level") == "sequence":
                        den = len(runs[i][1])
                    for k in METRICS[1:]:
                        within(abs(got[k] - want[k]) * den, near + den * 2.4e-7, f"{k} vs trl", where)  # TRL: fp32
                    if r["token_grads"] is not None and case.get("importance_sampling_level") != "sequence":
                        for got_c, want_c, bound_c in zip(r["token_grads"], want_token_grads, token_bounds, strict=True):
                            for x, y, b in zip(got_c, want_c, bound_c, strict=True):
                                within(abs(x - y), b + 1.2e-7 * abs(y), "grpo dloss/dlogp vs trl", where)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_matches_trl(lora, tmp_path):
    _check(*_policy_and_reference(tmp_path, lora), tmp_path)
