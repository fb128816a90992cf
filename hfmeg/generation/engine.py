"""The interface every generation engine offers the RL loop, and the sampling settings it takes.

`generate(prompts, params, seeds)` samples one completion per (prompt, seed) and returns each as a
`Completion` (data/rollouts.py): the prompt's ids, the completion's ids (ending with an end-of-sequence
token unless it ran to `max_new_tokens`, then `truncated`), and the engine's log-probability of each
completion token under softmax(logits / temperature) (the logits' own at temperature 0), before top-k and
top-p: the number the training forward recomputes (TRL's GRPO divides the training logits by the
temperature too), so their difference is the train/generation mismatch. `load(folder)`
takes new weights from an HF model folder (the trained shards exported: train/rollout.py); an in-process engine
also takes them as tensors by HF name (`TransformersEngine.load_tensors`, no file). `close()` frees the
engine (stops a vLLM worker process).

Sampling is seeded per completion (`seeds`): the same prompt, weights and seed give the same completion
whatever else is in the batch (up to the float rounding of other batch shapes, which could flip a draw
that falls on a boundary), and the same batch gives the same completions, so a resumed run regenerates
what an uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..data.rollouts import Completion


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]: ...

    def load(self, folder: Path) -> None: ...

    def close(self) -> None: ...
