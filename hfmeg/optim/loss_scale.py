"""Dynamic loss scaling for fp16 parameters.

The loss is multiplied by `scale` before backward so that small fp16 gradients do
not underflow; the optimizer divides the fp32 main grads by it again. A step whose
gradients contain Inf/NaN is skipped and the scale is halved (never below
`min_scale`); after `window` consecutive good steps it doubles.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    min_scale: float = 1.0
    window: int = 1000
    good_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2
            self.good_steps = 0
