"""The backend decides the device: gloo computes on the CPU, nccl on cuda:LOCAL_RANK.

CUDA is faked (`torch.cuda.is_available` / `device_count` monkeypatched), so the decision
and its wiring are tested on a CPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hfmeg.errors import LayoutError, UnsupportedConfigError
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import BACKEND_ENV, ParallelConfig, ParallelState, choose_backend


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` CUDA devices."""
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


def test_default_is_nccl_on_cuda_and_gloo_without(gpus):
    gpus(4)
    assert choose_backend(None, 2) == ("nccl", torch.device("cuda", 2))
    gpus(0)
    assert choose_backend(None, 2) == ("gloo", torch.device("cpu"))


def test_gloo_on_a_gpu_machine_stays_on_the_cpu_without_asking_cuda(monkeypatch):
    def no_cuda_calls():
        raise AssertionError("gloo must not query CUDA (a forked child cannot re-initialise it)")
    monkeypatch.setattr(torch.cuda, "is_available", no_cuda_calls)
    monkeypatch.setattr(torch.cuda, "device_count", no_cuda_calls)
    assert choose_backend("gloo", 5) == ("gloo", torch.device("cpu"))
    assert choose_backend("GLOO", 0) == ("gloo", torch.device("cpu"))


def test_bad_choices_are_one_clear_error(gpus):
    gpus(2)
    with pytest.raises(LayoutError, match=r"LOCAL_RANK=2 but this node has 2 visible CUDA device"):
        choose_backend("nccl", 2)
    with pytest.raises(UnsupportedConfigError, match=r"'mpi' is not supported \(use gloo or nccl\)"):
        choose_backend("mpi", 0)
    gpus(0)
    with pytest.raises(UnsupportedConfigError, match="nccl needs CUDA"):
        choose_backend("nccl", 0)


def test_from_env_binds_the_device_before_creating_the_group(gpus, monkeypatch):
    gpus(2)
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "init" for c in calls))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: calls.append(("init", kw["backend"], kw["device_id"])))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    ps = ParallelState.from_env(ParallelConfig())
    cuda1 = torch.device("cuda", 1)
    assert ps.device == cuda1
    assert calls == [("set_device", cuda1), ("init", "nccl", cuda1)]


def test_explicit_gloo_on_a_gpu_machine(gpus, monkeypatch):
    """$HFMEG_BACKEND=gloo lets a GPU machine run a CPU world (here a world of one)."""
    gpus(8)
    monkeypatch.setenv(BACKEND_ENV, "gloo")
    monkeypatch.delenv("RANK", raising=False)
    try:
        ps = ParallelState.from_env(ParallelConfig())
        assert ps.device == torch.device("cpu") and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def _device_in_child() -> tuple[str, bool]:
    return str(ParallelState.from_env(ParallelConfig()).device), torch.cuda.is_available()


def test_spawned_worlds_are_cpu_worlds_on_a_gpu_machine(gpus, monkeypatch):
    gpus(8)  # inherited by the forked ranks
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert spawn(_device_in_child, 2) == [("cpu", False), ("cpu", False)]


def test_rng_state_of_a_cpu_run_never_touches_cuda_on_a_gpu_machine(gpus, monkeypatch):
    """A gloo run on a GPU machine saves and restores only CPU generators (no CUDA context on GPU 0)."""
    from hfmeg.train.rng import rng_state, set_rng_state

    gpus(8)

    def no_cuda(*_a, **_k):
        raise AssertionError("a CPU run touched the CUDA generator")

    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_cuda)
    state = rng_state(torch.device("cpu"))
    assert "cuda" not in state
    set_rng_state({**state, "cuda": [0]}, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), torch.tensor(state["torch"], dtype=torch.uint8))
