"""A verifiable toy reward for trying GRPO on a tiny story model (docs/grpo.md): TRL's reward-function signature."""

from hfmeg.train.rewards import text_of


def park(prompts, completions, **kwargs):
    """1.0 where the completion mentions a park, else 0.0: rare enough in stories260K's samples to learn."""
    return [float("park" in text_of(c)) for c in completions]
