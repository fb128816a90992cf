"""A "parameters ready" barrier for code that reads model parameters outside a forward.

The overlapped distributed optimizer ends `step()` with each bucket's parameter
all-gather (launched by the data-parallel wrapper, data_parallel.py) still in flight: DP rank r holds its freshly updated shard, and the other
shards of its parameter buffers are filled by the network in the background. The next
forward waits for them bucket by bucket in pre-forward hooks, so forward passes
(training, evaluation, generation) always see finished weights. Everything else that
reads parameters — saving a checkpoint, from which export and parity checks read —
must wait first, or it mixes this step's shards with the previous step's.

So whatever writes parameters asynchronously (the wrapper) registers a barrier on each model chunk,
and every such reader calls `wait_params_ready(chunks)`. The barrier waits on the
collective's work handle: on CUDA that orders the current stream after NCCL's, so a
device-to-host copy issued afterwards reads the gathered values.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

_ATTR = "_hfmeg_params_ready"


def set_params_barrier(module: nn.Module, wait: Callable[[], None]) -> None:
    """Make `wait_params_ready` on `module` call `wait` (which returns once its parameters are final)."""
    setattr(module, _ATTR, wait)


def wait_params_ready(modules: Iterable[nn.Module]) -> None:
    """Return once no asynchronous write to the parameters of `modules` is in flight."""
    for m in modules:
        wait = getattr(m, _ATTR, None)
        if wait is not None:
            wait()


_BLOCK = "_hfmeg_compiled_block"


def mark_compiled_block(module: nn.Module) -> None:
    """Say that `module`'s forward is compiled as one graph: whoever waits for parameters before a module runs
    waits for everything inside `module` before it instead (a wait inside the graph would be traced into it)."""
    setattr(module, _BLOCK, True)


def is_compiled_block(module: nn.Module) -> bool:
    return getattr(module, _BLOCK, False)
