"""tools/bench_attention.py at smoke size on the CPU: the JSON-lines contract. No timing is asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tool_loader import load_tool



def _tool():
    return load_tool("bench_attention")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke defaults apply only without a GPU")
def test_smoke_run_prints_one_json_line_per_path_and_document_count(capsys):
    rows = _tool().main(["--seq", "64", "--docs", "1,5", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr()
    assert "no GPU, small fp32 smoke shapes" in out.err
    lines = [json.loads(x) for x in out.out.splitlines() if x.startswith("{")]
    assert lines == json.loads(json.dumps(rows))
    assert [(r["documents"], r["path"]) for r in lines] == [
        (n, p) for n in (1, 5) for p in ("sdpa_causal", "dense_mask", "document_causal")]
    for r in lines:
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["smoke"] is True
        assert r["ms"] > 0 and r["mask_ms"] >= 0 and r["shapes"]["seq"] == 64
        if r["path"] == "sdpa_causal":
            assert r["ratio_vs_causal"] == 1.0
    kernels = {r["documents"]: r["kernel"] for r in lines if r["path"] == "document_causal"}
    assert kernels == {1: "sdpa causal", 5: "sdpa dense mask"}
    packed = next(r for r in lines if r["path"] == "document_causal" and r["documents"] == 5)
    assert packed["block_mask_ms"] > 0 and packed["create_block_mask_ms"] > 0
    assert packed["block_mask_speedup"] == packed["create_block_mask_ms"] / packed["block_mask_ms"]
    assert not any("block_mask_ms" in r for r in lines if r is not packed)


def test_segment_ids_fill_the_row_with_the_asked_documents():
    seg = _tool().segment_ids(14, 4096, 2, np.random.default_rng(0))
    assert seg.shape == (2, 4096)
    for row in seg:
        assert row.unique().tolist() == list(range(1, 15)) and bool((row.diff() >= 0).all())


def test_bad_arguments_exit_2_with_one_message(capsys):
    tool = _tool()
    for argv, field in ((["--heads", "5", "--kv-heads", "2"], "--heads"), (["--seq", "0"], "--seq"),
                        (["--docs", "1,x"], "--docs"), (["--docs", "99", "--seq", "64"], "--docs")):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(argv, cuda=False)
        assert e.value.code == 2
        assert field in capsys.readouterr().err.strip().splitlines()[-1]
