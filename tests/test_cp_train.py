"""Context-parallel training equals one process, and a CP run resumes at another CP size.

stories260K on alpaca_en_demo.json, rows of 64 packed tokens (several documents per row,
so the document mask crosses the split), fp32. CP is a runtime layout like DP: the
checkpoint of a CP2 x DP2 run resumes at CP4 and continues as the CP2 x DP2 run did.
The three optimizer modes shard or replicate over DP x CP: CP2 x TP2 runs `distributed`,
CP2 x DP2 `ddp`, the CP4 resume `overlapped` (from the `ddp` run's state).
"""

from __future__ import annotations

import json
from dataclasses import replace

from bounds import report
from hfmeg.parallel.launch import spawn
from hfmeg.train.metrics import read_metrics
from optim_harness import FP32_EPS, ROUNDING_FACTOR, loss_distance
from test_train import _assets, _config, _losses, _run


def _cp_config(out, model, *, cp, tp=1, mode="overlapped", **kw):
    cfg = _config(out, model, tp=tp, sp=tp > 1, steps=20, **kw)
    return replace(cfg, parallel=replace(cfg.parallel, cp=cp), optim=replace(cfg.optim, mode=mode))


def _close(a, b):
    # fp32 sums of the same terms in other orders over 20 Adam steps: the layout contract's 1e-4. Every run is in
    # launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves these losses.
    if len(a) != len(b):
        return False
    report(max(abs(x - y) / abs(x) for x, y in zip(a, b)), 1e-4, "cp loss rel")
    return all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(a, b))


def _tokens(out):
    return [r["tokens"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _state(checkpoint):
    """What a checkpoint holds beside the tensors, less the run's own settings and DP size (which name its layout)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["config"], state["dp"]
    return state, sorted(p.read_text() for p in (checkpoint / "rng").iterdir())


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
    resumed, source = tmp_path / "cp4", tmp_path / "cp2dp2"
    spawn(_run, 4, _cp_config(resumed, model, cp=4, save_every=10,
                              resume=str(source / "checkpoints" / "iter_0000010")))
    got, expect = _losses(resumed), _losses(source)[10:]
    assert len(got) == 10
    # Bit for bit at another CP: the data stream (the label tokens of every step, the stream position and the
    # packer's open rows at step 20) and the RNG state; a checkpoint does not depend on CP.
    assert _tokens(resumed) == _tokens(source)[10:]
    assert _state(resumed / "checkpoints" / "iter_0000020") == _state(source / "checkpoints" / "iter_0000020")
    # The losses are not: CP4 sums every step's terms in another order than CP2 x DP2 (attention over other
    # K/V splits, 4 CP partial gradients in place of 2 x 2). Step 11 is a forward of the restored weights, the
    # later ones follow Adam updates from gradients rounded differently. The bound is what a change of
    # summation order does to this run, measured in it: the CP2 x TP2 and CP2 x DP2 runs' distance from one
    # process (another order of the same fp32 terms from the same start, ~5e-7 here), times
    # optim_harness's ROUNDING_FACTOR for the spread between orders, plus 2 eps for each of the 32 fp32
    # partial losses (8 micro-batches x 4 CP ranks) a step's loss adds up. ~1e-5: a stale optimizer moment,
    # a skipped or repeated row or a wrong step of the LR schedule moves a loss by 1e-3 or more.
    spread = max(loss_distance(_losses(tmp_path / name), single) for name in ("cp2tp2", "cp2dp2"))
    bound = ROUNDING_FACTOR * spread + 2 * 32 * FP32_EPS
    assert loss_distance(got, expect) <= bound, (got, expect, bound)
