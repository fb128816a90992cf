"""`--layout auto`: the hardware a training job runs on, and the two lines it prints about its layout.

The trainer knows the model, the world (ranks, ranks per node), the global batch and
the sequence length; what it lacks is a description of the hardware. `detect_cluster`
reads it off the device:

- CUDA: the GPU kind from the device name (`hardware.gpu_kind`), with its
  datasheet figures and the assumed profile of `profile.ASSUMED`), its memory from the
  device itself; one node per `LOCAL_WORLD_SIZE` ranks. An unknown GPU is refused with
  the line that says what to do instead. Deterministic: every rank would answer the same.
- CPU (gloo ranks): the host's memory shared by the local ranks, and a profile measured
  here and now in a fraction of a second (`calibrate(in_job=True)`: matmul and attention
  rates, bandwidth, the fixed costs of a layer); the link is gloo over loopback at the
  figures below. That quick profile cannot measure what ranks sharing the host cost
  each other; a full `hfmeg plan calibrate` profile can (`parallel.plan_profile`, on
  GPUs too, in place of the assumed one). Not deterministic (timings), so the trainer
  measures on rank 0 and broadcasts the choice. On a CPU the choice matters for memory (what fits) far more
  than for speed.

The trainer ranks the layouts with `search.best_layout` (train/auto_layout.py);
`choice_line` is the line it prints at start, `report` the line after its first timed
steps: predicted against measured step time and peak memory, so the user sees how far
to trust the choice.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..errors import UnsupportedConfigError
from .calibrate import calibrate
from .hardware import GIB, GPUS, ClusterSpec, GpuSpec, gpu_kind
from .profile import Profile, default_profile, load_profile
from .search import Evaluation

# gloo all-reduce between two ranks over loopback, as `hfmeg plan calibrate` measured it on
# a 2-core VM (0.76 GB/s, 140 us), rounded: CPU ranks of one host talk through these.
GLOO_BYTES_PER_S = 1e9
GLOO_LATENCY_S = 1e-4


def cpu_cluster(profile: Profile, ranks: int, per_host: int | None = None,
                memory_per_rank: float = float("inf"), **links) -> ClusterSpec:
    """`ranks` gloo ranks, `per_host` (default all) on each host: the profile's gloo link measured with
    that many ranks on the host (a profile without one: the loopback figures above); `links`: the
    `ClusterSpec`'s link between hosts (`inter_node_bytes_per_s`, `inter_node_latency_s`)."""
    per_host = per_host or ranks
    bw, latency = profile.link(per_host) or (GLOO_BYTES_PER_S, GLOO_LATENCY_S)
    spec = GpuSpec("cpu", profile.peak_flops, memory_per_rank, profile.memory_bytes_per_s, bw)
    return ClusterSpec(spec, ranks, per_host, intra_node_latency_s=latency, reserved_bytes=0, **links)


def detect_cluster(world_size: int, local_world_size: int, device: torch.device,
                   profile_path: str | None = None) -> tuple[ClusterSpec, Profile]:
    """The cluster this job runs on, and the profile to time it with: `profile_path`'s
    (`parallel.plan_profile`) when given, else the GPU kind's assumed one or, on CPU ranks,
    one measured here."""
    given = load_profile(profile_path) if profile_path else None
    if given is not None and given.gloo != (device.type == "cpu"):
        raise UnsupportedConfigError(f"parallel.plan_profile: {profile_path} was calibrated on a "
                                     f"{'CPU' if given.gloo else 'GPU'}, and this run is on {device.type}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind = gpu_kind(props.name, props.total_memory)
        if kind is None:
            raise UnsupportedConfigError(
                f"parallel.layout: auto knows {', '.join(GPUS)} GPUs, not {props.name!r}; use --layout manual "
                "with a layout from `hfmeg plan --gpu custom ...`")
        spec = replace(GPUS[kind], memory_bytes=float(props.total_memory))
        return ClusterSpec(spec, world_size, local_world_size), given or default_profile(kind, spec.peak_flops,
                                                                                         spec.hbm_bytes_per_s)
    profile = given or calibrate("cpu", max_n=512, repeats=3, name="cpu (measured at start)", in_job=True)
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return cpu_cluster(profile, world_size, local_world_size, host / local_world_size), profile


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def choice_line(ev: Evaluation, cluster: ClusterSpec, why: str) -> str:
    """The line a run prints at start: the layout, why this one, and what the planner expects of it."""
    t = ev.time
    return (f"layout auto: {ev.layout.name()} ({why}; {cluster.gpus} x {cluster.gpu.name}, "
            f"{_size(cluster.usable_memory)} usable each): predicted {_size(ev.memory.total)}/GPU, "
            f"step {t.step_s:.3f} s, {t.tokens_per_s_per_gpu:.0f} tokens/s/GPU")


def report(ev: Evaluation, measured_step_s: float, measured_peak_bytes: int | None) -> str:
    """One line: the planner's prediction for the chosen layout against what the run measured.

    Errors are predicted / measured - 1, as in README's GPU table: + means the planner
    over-estimated."""
    t = f"step {measured_step_s:.3f} s measured vs {ev.time.step_s:.3f} s predicted " \
        f"({ev.time.step_s / measured_step_s - 1:+.0%})"
    if measured_peak_bytes is None:
        m = f"memory {_size(ev.memory.total)}/GPU predicted (not measured off CUDA)"
    else:
        m = f"memory {_size(measured_peak_bytes)}/GPU measured vs {_size(ev.memory.total)} " \
            f"predicted ({ev.memory.total / measured_peak_bytes - 1:+.0%})"
    return f"layout {ev.layout.name()}: {t}; {m}"
