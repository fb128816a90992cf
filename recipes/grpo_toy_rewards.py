"""A verifiable toy reward for trying GRPO on a tiny story model (docs/grpo.md): TRL's reward-function signature."""

from hfmeg.train.rewards import text_of


def park(prompts, completions, **kwargs):
    """1.0 where the completion mentions a park, else 0.0: rare enough in stories260K's samples to learn."""
    return [float("park" in text_of(c)) for c in completions]


def the(prompts, completions, **kwargs):
    """1.0 where the completion has the word "the": about half the samples of a barely trained model (the head_dim 32
    regrouping of stories260K that vLLM can serve, docs/grpo.md), so both outcomes are there to learn from."""
    return [float(" the " in f" {text_of(c)} ") for c in completions]
