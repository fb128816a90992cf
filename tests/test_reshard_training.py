"""tools/reshard_mp.py on a training checkpoint reshards it whole (issue 18 #7): a TP=2 run's checkpoint,
resharded to TP=1 x PP=2, resumes and continues as the TP=2 run did (model, optimizer, step, data position)."""

from __future__ import annotations

import json

from bounds import within
from hfmeg.parallel.launch import spawn
from test_train import _assets, _config, _losses, _run
from tool_loader import load_tool


def _reshard_tool():
    return load_tool("reshard_mp").main


def test_a_resharded_training_checkpoint_resumes_the_run(tmp_path, capsys):
    model = _assets()
    straight = tmp_path / "straight"
    spawn(_run, 2, _config(straight, model, tp=2, steps=6, save_every=3))
    source = straight / "checkpoints" / "iter_0000003"
    new = tmp_path / "tp1pp2"
    assert _reshard_tool()(["--mp", str(source), "--out", str(new), "--tp", "1", "--pp", "2"]) == 0
    said = capsys.readouterr().out
    assert f"continue with --tp 1 --pp 2 --vpp 1 --resume {new / 'iter_0000003'}" in said, said
    assert json.loads((new / "iter_0000003" / "trainer_state.json").read_text())["step"] == 3
    resumed = tmp_path / "resumed"
    spawn(_run, 2, _config(resumed, model, tp=1, pp=2, steps=6, resume=str(new / "iter_0000003")))
    expect, got = _losses(straight)[3:], _losses(resumed)
    assert len(got) == 3, (got, expect)
    # Every run in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves
    # these losses (docs/testing.md, bounds). The layout contract's 1e-4: fp32 sums in other orders over 3 steps.
    within(max(abs(a - b) / abs(b) for a, b in zip(got, expect)), 1e-4, "resharded resume loss rel", (got, expect))
