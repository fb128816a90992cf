"""tools/bench_wgrad_fusion.py: without CUDA it says what it needs in one line and exits 2 (its figures are GPU-only,
README "GPU speed"); with CUDA, one JSON line per shape (tests/test_gpu.py runs nothing of it: timings, no parity)."""

from __future__ import annotations

import pytest
import torch

from tool_loader import load_tool


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_cuda_one_line_and_exit_2(capsys):
    assert load_tool("bench_wgrad_fusion").main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        "bench_wgrad_fusion: needs a CUDA GPU (torch's addmm with out_dtype runs on CUDA only)"]
