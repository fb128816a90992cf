"""Context-parallel training equals one process, and a CP run resumes at another CP size.

stories260K on alpaca_en_demo.json, rows of 64 packed tokens (several documents per row,
so the document mask crosses the split), fp32. CP is a runtime layout like DP: the
checkpoint of a CP2 x DP2 run resumes at CP4 and continues as the CP2 x DP2 run did.
The three optimizer modes shard or replicate over DP x CP: CP2 x TP2 runs `distributed`,
CP2 x DP2 `ddp`, the CP4 resume `overlapped` (from the `ddp` run's state).
"""

from __future__ import annotations

from dataclasses import replace

from bounds import report
from hfmeg.parallel.launch import spawn
from test_train import _assets, _config, _losses, _run


def _cp_config(out, model, *, cp, tp=1, mode="overlapped", **kw):
    cfg = _config(out, model, tp=tp, sp=tp > 1, steps=20, **kw)
    return replace(cfg, parallel=replace(cfg.parallel, cp=cp), optim=replace(cfg.optim, mode=mode))


def _close(a, b):
    # fp32 sums of the same terms in other orders over 20 Adam steps: the layout contract's 1e-4.
    if len(a) != len(b):
        return False
    report(max(abs(x - y) / abs(x) for x, y in zip(a, b)), 1e-4, "cp loss rel")
    return all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(a, b))


def test_cp_training_matches_one_process_and_resumes_at_another_cp(tmp_path):
    model = _assets()
    spawn(_run, 1, _config(tmp_path / "single", model, steps=20))
    spawn(_run, 4, _cp_config(tmp_path / "cp2tp2", model, cp=2, tp=2, mode="distributed"))
    spawn(_run, 4, _cp_config(tmp_path / "cp2dp2", model, cp=2, mode="ddp", save_every=10))
    single = _losses(tmp_path / "single")
    assert len(single) == 20
    for name in ("cp2tp2", "cp2dp2"):
        assert _close(single, _losses(tmp_path / name)), (name, single, _losses(tmp_path / name))
    # Steps 11-20 at CP4 (DP 1) from the CP2 x DP2 run's step-10 checkpoint: model, optimizer and data position.
    resumed = tmp_path / "cp4"
    spawn(_run, 4, _cp_config(resumed, model, cp=4, resume=str(tmp_path / "cp2dp2" / "checkpoints" / "iter_0000010")))
    got, expect = _losses(resumed), _losses(tmp_path / "cp2dp2")[10:]
    assert len(got) == 10 and _close(expect, got), (got, expect)
