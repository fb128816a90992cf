"""RNG state capture and restore, so a resumed run draws the same random numbers."""

from __future__ import annotations

import random

import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """Python and torch generator states as JSON-able lists: CPU, and CUDA when the run's device is a GPU.

    The run's device decides, not whether CUDA exists: a gloo (CPU) run on a GPU machine must not open
    a CUDA context on GPU 0 in every process just to read its generator.
    """
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "torch": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)
