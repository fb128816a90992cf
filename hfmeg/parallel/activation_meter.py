"""Bytes of activations that autograd keeps for backward, live and at their peak.

Every tensor autograd saves inside `SavedTensorMeter.hooks()` passes through a
`saved_tensors_hooks` pack hook; the meter counts its storage once however many
ops save it, and a small holder object un-counts it when autograd drops the saved
reference (after that micro-batch's backward). Parameters are excluded. This is
what a pipeline schedule's in-flight micro-batches cost: 1F1B keeps at most
pp − rank micro-batches' worth on stage rank, GPipe all of them.
"""

from __future__ import annotations

import torch


class SavedTensorMeter:
    """Live bytes of tensors saved for backward (each storage counted once), and their peak."""

    def __init__(self, modules):
        # Parameters are saved for backward too, but they are not activations.
        self.exclude = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.refs: dict[int, tuple[int, int]] = {}  # storage -> (saved references, bytes)
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self.exclude:
            return t
        return _Held(self, key, t, t.untyped_storage().nbytes())

    @staticmethod
    def unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    def hooks(self):
        """Context manager: count what autograd saves inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor, nbytes: int):
        self.meter, self.key, self.tensor = meter, key, tensor
        count, _ = meter.refs.get(key, (0, nbytes))
        if count == 0:
            meter.live += nbytes
            meter.peak = max(meter.peak, meter.live)
        meter.refs[key] = (count + 1, nbytes)

    def __del__(self):
        count, nbytes = self.meter.refs[self.key]
        if count == 1:
            del self.meter.refs[self.key]
            self.meter.live -= nbytes
        else:
            self.meter.refs[self.key] = (count - 1, nbytes)
