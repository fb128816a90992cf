"""Shared-unlock warm start: every decoder layer uses the first layer's parameters until a step.

AngelPTM's "shared-unlock" pretraining (issue 16): a model trained from random weights
first runs all N layers with one set of layer parameters, so the layers' gradient
traffic and optimizer state are 1/N; at `train.shared_layers_until` each layer gets
its own copy of the parameters and of their Adam moments and training goes on unshared.

Sharing is done with Parameter identity, not with a new module: `share_layers` sets
the first layer's `nn.Parameter` objects on the same-named attribute of every other
layer's modules. Everything downstream then does the right thing unchanged:

- the forward runs N layers exactly as before, each with its own (non-parameter)
  settings, e.g. GPT-2's per-layer attention scale;
- autograd sums the N uses' gradients into the one leaf before its
  accumulate-gradient hook fires once per backward, so the data-parallel wrapper's
  `main_grad` (parallel/grad_sync.py) receives the sum of the per-layer gradients
  (with 16-bit parameters that sum is formed in their dtype, then added in fp32);
- `named_roles`/`named_parameters` deduplicate by identity, so the wrapper's buffers
  and buckets, the reductions and the optimizer's master weights and moments hold each
  shared tensor once, under the first layer's names (`layers.<first>.…`); roles are
  recorded per module and attribute name (parallel/roles.py), and every layer declared
  the same roles, so they resolve wherever the wrapper looks;
- a checkpoint writes every layer's tensors (`named_parameters(remove_duplicate=False)`
  in checkpoint/mp_save.py), each equal to the shared one, so it exports to a complete
  HF model and loads into either phase.

The unlock (train/trainer.py) reloads that checkpoint into an unshared chunk and the
optimizer state into the new optimizer, every layer's pieces taken from the first
layer's names (`shared_name`, handed to optim/state_io.py's by-name loader). The
unlocked model holds bit-identical weights, so it computes exactly what the shared one
did, and its moments are the shared moments in every layer.

Limits: one model chunk per rank (PP = 1: with pipeline stages, layers live on other
ranks), and dense models (MoE layers differ in structure, and their experts live in
expert-parallel buffers); `check_shareable` refuses the rest naming the field.
"""

from __future__ import annotations

import re

from torch import nn

from ..config import ModelConfig
from ..errors import UnsupportedConfigError

FIELD = "train.shared_layers_until"
_LAYER = re.compile(r"^layers\.\d+\.")


def check_shareable(cfg: ModelConfig, pp: int) -> None:
    """Refuse, naming the field, what shared layers are not offered for (see the module docstring)."""
    if pp > 1:
        raise UnsupportedConfigError(f"{FIELD}: shared layers need every layer on one rank; parallel.pp is {pp}, "
                                     "use pp 1 (or shared_layers_until 0)")
    if cfg.moe is not None:
        raise UnsupportedConfigError(f"{FIELD}: shared layers are for dense models; this model has MoE layers "
                                     "(set shared_layers_until 0)")


def share_layers(chunk: nn.Module) -> None:
    """Make every decoder layer of `chunk` use the first layer's Parameter objects (in place).

    Call it before the data-parallel wrapper takes the parameters over; the first layer's
    current values become every layer's."""
    check_shareable(chunk.cfg, chunk.ps.pp)
    layers = list(chunk.layers.values())
    first = dict(layers[0].named_modules())
    for layer in layers[1:]:
        for name, module in layer.named_modules():
            for attr, p in first[name].named_parameters(recurse=False):
                mine = getattr(module, attr)
                if mine.shape != p.shape or mine.dtype != p.dtype:
                    raise UnsupportedConfigError(f"{FIELD}: layer parameter {name}.{attr} differs in shape or dtype "
                                                 "between layers, so the layers cannot share it")
                setattr(module, attr, p)


def shared_name(name: str) -> str:
    """The shared tensor an unshared parameter `name` starts from: `layers.7.mlp.w` -> `layers.0.mlp.w`
    (PP = 1, so the first layer is layer 0)."""
    return _LAYER.sub("layers.0.", name)
