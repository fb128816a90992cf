"""Reward functions for online RL: TRL's signature, a few built in, any user callable by its import path.

A reward function is called as TRL calls one: `f(prompts=[...], completions=[...], **columns)`, one
entry per completion, the dataset's other columns (`solution`, `answer`, ...) as lists beside them, and
returns one float or None per completion (None: the function does not apply to that completion, left out
of its score, as TRL leaves it out). A completion is a string, or for a conversational prompt TRL's
`[{"role": "assistant", "content": text}]`.

`--reward-funcs` names them: a built-in's name (`REGISTRY`) or `module:function` / `module.function`.
What a function does wrong (raises, returns the wrong count, a NaN, something not a number) is a
`RewardError`: one line naming the function and the first prompt concerned.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Any, Callable

import torch

from ..errors import HfmegError

RewardFunc = Callable[..., list[float | None]]


class RewardError(HfmegError):
    """A reward function that cannot be imported or misbehaves (names the function and the prompt)."""


def text_of(completion: Any) -> str:
    """A completion's text: the string, or the last message's content of a conversational one."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The answer a text ends with: what follows the last `####` (GSM8K's marker) if any, else the last number
    (commas dropped), else the stripped text."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else text.strip()


def accuracy(prompts, completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the completion's final answer equals the record's (`solution`, else `answer`; `final_answer`),
    else 0.0; None where the record has neither."""
    truth = solution if solution is not None else answer
    if truth is None:
        return [None] * len(completions)
    return [None if t is None else float(final_answer(text_of(c)) == final_answer(str(t)))
            for c, t in zip(completions, truth, strict=True)]


THINK_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)


def think_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the completion is `<think>...</think>` then `<answer>...</answer>` (each on its own lines), else 0."""
    return [float(bool(THINK_FORMAT.match(text_of(c)))) for c in completions]


REGISTRY: dict[str, RewardFunc] = {"accuracy": accuracy, "think_format": think_format}


def resolve(name: str) -> RewardFunc:
    """A built-in by name, or `module:function` / `module.function` imported."""
    if name in REGISTRY:
        return REGISTRY[name]
    module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not (module and sep and attr):
        raise RewardError(f"reward function {name!r}: not a built-in ({', '.join(REGISTRY)}) nor module:function")
    try:
        f = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"reward function {name!r}: cannot import ({type(e).__name__}: {e})") from e
    if not callable(f):
        raise RewardError(f"reward function {name!r}: {type(f).__name__} is not callable")
    return f


def name_of(f: RewardFunc) -> str:
    return getattr(f, "__name__", type(f).__name__)


def score(funcs: list[RewardFunc], prompts: list, completions: list, columns: dict[str, list]) -> torch.Tensor:
    """The rewards `[completions, functions]` float32, NaN where a function returned None (module doc)."""
    out = torch.full((len(completions), len(funcs)), math.nan, dtype=torch.float32)
    for j, f in enumerate(funcs):
        name = name_of(f)
        try:
            values = f(prompts=prompts, completions=completions, **columns)
        except Exception as e:  # a user's function: whatever it raises is its own failure, named
            raise RewardError(f"reward function {name} raised {type(e).__name__}: {e} (prompt {prompts[0]!r})") from e
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise RewardError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                              f"completions (prompt {prompts[0]!r})")
        for i, v in enumerate(values):
            if v is None:
                continue
            if not isinstance(v, numbers.Real) or math.isnan(v):
                raise RewardError(f"reward function {name} returned {v!r} for a completion of prompt "
                                  f"{prompts[i]!r}: a reward is a float or None")
            out[i, j] = float(v)
    return out
