"""RNG state capture and restore, so a resumed run draws the same random numbers."""

from __future__ import annotations

import random

import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Python and torch (CPU and, when present, CUDA) generator states as JSON-able lists."""
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
