"""What the planner knows about the machines: GPU kinds and the cluster around them.

A `GpuSpec` is the vendor's datasheet (dense bf16 peak without sparsity, memory,
HBM bandwidth); how much of that peak real matmuls reach, and what the links
really carry, is measured (`hfmeg plan calibrate`) and lives in a `Profile`
(profile.py), not here. A `ClusterSpec` adds how GPUs are grouped into nodes and
the two link levels: inside a node (NVLink) and between nodes (the NICs, shared
by all GPUs of the node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import UnsupportedConfigError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 (fp32 on a CPU profile) FLOP/s
    memory_bytes: float  # what the framework can allocate, after the CUDA context (see usable_memory)
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU, one direction (NVLink)


# Datasheet figures (NVIDIA A100 / H100 / H200 datasheets, SXM parts, dense bf16; L40S and A10 are PCIe cards
# without NVLink, so GPUs of a node talk over PCIe Gen4 x16).
GPUS: dict[str, GpuSpec] = {
    "a100-40": GpuSpec("A100-SXM4-40GB", 312e12, 40 * GIB, 1.555e12, 300 * GB),
    "a100-80": GpuSpec("A100-SXM4-80GB", 312e12, 80 * GIB, 2.039e12, 300 * GB),
    "h100": GpuSpec("H100-SXM5-80GB", 989e12, 80 * GIB, 3.35e12, 450 * GB),
    "h200": GpuSpec("H200-SXM-141GB", 989e12, 141 * GB, 4.8e12, 450 * GB),
    "l40s": GpuSpec("L40S-48GB", 362e12, 48 * GB, 0.864e12, 32 * GB),
    "a10": GpuSpec("A10-24GB", 125e12, 24 * GB, 0.6e12, 32 * GB),
}


def gpu_kind(device_name: str, memory_bytes: float) -> str | None:
    """The shipped kind (a key of GPUS) a CUDA device name stands for, or None (e.g. an A10G, a consumer card)."""
    n = device_name.upper()
    for mark, kind in (("H200", "h200"), ("H100", "h100"), ("L40S", "l40s")):
        if mark in n:
            return kind
    if "A100" in n:
        return "a100-80" if memory_bytes > 48 * GIB else "a100-40"
    return "a10" if re.search(r"\bA10\b", n) else None


# Memory the allocator cannot use: CUDA context, NCCL and cuBLAS workspaces, fragmentation.
RESERVED_BYTES = 3 * GIB


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GpuSpec
    gpus: int
    gpus_per_node: int = 8
    inter_node_bytes_per_s: float = 100e9 / 8  # per node, one direction (all NICs together)
    inter_node_latency_s: float = 10e-6
    intra_node_latency_s: float = 5e-6
    reserved_bytes: float = RESERVED_BYTES

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise UnsupportedConfigError(f"cluster: --gpus ({self.gpus}) and --gpus-per-node "
                                         f"({self.gpus_per_node}) must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise UnsupportedConfigError(f"cluster: --gpus {self.gpus} is not a whole number of "
                                         f"{self.gpus_per_node}-GPU nodes")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def usable_memory(self) -> float:
        return self.gpu.memory_bytes - self.reserved_bytes

    def link(self, group_size: int, stride: int, all_to_all: bool = False, *,
             crosses: bool) -> tuple[float, float]:
        """(bytes/s per GPU, latency) of a collective over `group_size` ranks `stride` apart in the rank grid;
        `crosses`: whether the rank grid puts the group on more than one node (`RankGrid.crossing`).

        A group that stays inside one node rides NVLink. One that spans nodes is limited
        by the NICs, which all groups of a node share when every group communicates at
        once (DP, EP and PP groups do). A node holds k = min(group, G/stride) members of
        a group and G/k groups. A ring (all-reduce, reduce-scatter, all-gather) crosses
        each node boundary once (NCCL orders it node by node, one channel per NIC), so
        the k members send one ring's worth off the node together: each group gets
        inter_node · k/G, and a rank's ring traffic moves at that rate. In an all-to-all
        every member sends its own (n − k)/n off the node, each at inter_node / G; the
        rate returned is the one at which the whole (n − 1)/n of a rank's bytes move.
        """
        if group_size == 1 or not crosses:  # one rank sends nothing
            return self.gpu.intra_node_bytes_per_s, self.intra_node_latency_s
        per_gpu = self.inter_node_bytes_per_s / min(self.gpus_per_node, self.gpus)
        k = min(group_size, max(1, self.gpus_per_node // stride))
        rate = per_gpu * (group_size - 1) / (group_size - k) if all_to_all else per_gpu * k
        return min(rate, self.gpu.intra_node_bytes_per_s), self.inter_node_latency_s


def gpu_spec(kind: str, *, peak_tflops: float | None = None, memory_gb: float | None = None,
             hbm_gbps: float | None = None, nvlink_gbps: float | None = None) -> GpuSpec:
    """A shipped GPU kind (numbers may be overridden), or `custom` built from the numbers alone."""
    given = {"peak_flops": peak_tflops and peak_tflops * 1e12, "memory_bytes": memory_gb and memory_gb * GB,
             "hbm_bytes_per_s": hbm_gbps and hbm_gbps * GB, "intra_node_bytes_per_s": nvlink_gbps and nvlink_gbps * GB}
    given = {k: v for k, v in given.items() if v}
    if kind == "custom":
        missing = [f for f in ("peak_flops", "memory_bytes", "hbm_bytes_per_s") if f not in given]
        if missing:
            raise UnsupportedConfigError("--gpu custom needs --peak-tflops, --memory-gb and --hbm-gbps "
                                         f"(missing: {', '.join(missing)})")
        given.setdefault("intra_node_bytes_per_s", 300 * GB)
        return GpuSpec("custom", **given)
    if kind not in GPUS:
        raise UnsupportedConfigError(f"--gpu {kind!r} is not known (known: {', '.join(GPUS)}, custom)")
    return replace(GPUS[kind], **given)


def seed_cluster() -> ClusterSpec:
    """The issue's example: 16 nodes x 8 A100-40GB on 100 Gbps Ethernet."""
    return ClusterSpec(GPUS["a100-40"], 128, 8, inter_node_bytes_per_s=100e9 / 8, inter_node_latency_s=20e-6)
