"""When each stage ran each forward and backward: recording, bubble accounting, PNG.

Pass a `Timeline` to `forward_backward`; it records one `Event` per action with
wall-clock start/end (`time.perf_counter`, which on Linux is the system-wide
monotonic clock, so events from processes on one machine share a time axis).
Collect every stage's events on one process (e.g. `dist.gather_object`) and
`draw` them (one panel per schedule) as a picture like the schedule figures of the Megatron-LM paper: one
row per stage, forwards blue, backwards green, the micro-batch number in each box,
a darker shade per later virtual chunk. matplotlib is optional and only imported
by `draw`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F" or "B"
    chunk: int  # virtual chunk on the stage
    microbatch: int
    start: float
    end: float


class Timeline:
    def __init__(self, stage: int):
        self.stage = stage
        self.events: list[Event] = []

    @contextmanager
    def span(self, action):
        start = time.perf_counter()
        yield
        self.events.append(Event(self.stage, action.kind, action.chunk, action.microbatch, start,
                                 time.perf_counter()))


def bubble_fractions(events: list[Event]) -> dict[int, float]:
    """Per stage: idle time / busy time over the span of the whole pipeline step.

    This is the quantity the theory (p−1)/m (or (p−1)/(v·m) interleaved) describes:
    bubble time relative to the ideal, bubble-free compute time. Communication
    waits count as idle.
    """
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    busy: dict[int, float] = {}
    for e in events:
        busy[e.stage] = busy.get(e.stage, 0.0) + (e.end - e.start)
    return {s: (end - start - b) / b for s, b in sorted(busy.items())}


def draw(panels: list[tuple[str, list[Event]]], path: str | Path) -> Path:
    """Save one picture with a panel per (title, events of all stages) as a PNG at `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # optional dependency
        raise ImportError("drawing a pipeline timeline needs matplotlib: pip install matplotlib") from e
    rows = [len({e.stage for e in events}) for _, events in panels]
    width = max(8.0, min(24.0, max(len(ev) / n for (_, ev), n in zip(panels, rows)) * 0.45))
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, sum(0.7 * n + 1.2 for n in rows)),
                             height_ratios=[n + 1.2 for n in rows], squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], panels):
        _panel(ax, plt, title, events)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def _panel(ax, plt, title: str, events: list[Event]) -> None:
    from matplotlib.patches import Patch

    t0 = min(e.start for e in events)
    stages = sorted({e.stage for e in events})
    vpp = max(e.chunk for e in events) + 1
    span_ms = (max(e.end for e in events) - t0) * 1e3
    blues, greens = plt.get_cmap("Blues"), plt.get_cmap("Greens")
    for e in events:
        shade = 0.45 + 0.4 * (e.chunk / max(1, vpp - 1)) if vpp > 1 else 0.6
        color = (blues if e.kind == "F" else greens)(shade)
        x, w = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
        ax.broken_barh([(x, w)], (e.stage - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.5)
        if w > span_ms / 120:
            ax.text(x + w / 2, e.stage, str(e.microbatch + 1), ha="center", va="center", fontsize=7,
                    color="white" if shade > 0.7 else "black")
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span_ms * 1.01)
    handles = [Patch(color=blues(0.6), label="forward"), Patch(color=greens(0.6), label="backward")]
    if vpp > 1:
        handles.append(Patch(color="white", label="darker = later virtual chunk"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncols=len(handles),
              frameon=False)
    ax.set_title(title, fontsize=10, loc="left")
