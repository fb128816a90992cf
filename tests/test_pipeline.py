"""Pipeline schedules composed with TP, SP and DP: loss and every gradient vs one process.

Each gloo world runs many (layout, schedule, recompute) cases back to back. The test
process builds the HF checkpoint as one unsharded `ModelChunk` (a world-1
ParallelState) and runs the whole global batch through it, in float64 and fp32, as the
reference of every rank (once, not on each rank); each rank runs
its own stage under the pipeline schedule on its DP share of the micro-batches,
with the data-parallel wrapper in `ddp` mode finishing the gradients (SP, tied
embedding, DP sums), rebuilds full-shape HF gradients
from the TP shards with `checkpoint.rules.to_hf`, and compares. The parent checks
that the ranks together covered every reference gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.data.microbatch import MicroBatch
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.p2p import ACTIVATION, GRADIENT, P2P, Transfer
from hfmeg.parallel.pipeline import forward_backward
from optim_harness import check_within_rounding, truth_of
from helpers import gather_tp
from tiny_models import STORIES, save_tiny

CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # key of the folders dict
    tp: int
    pp: int
    schedule: str
    vpp: int = 1
    sp: bool = False
    microbatches: int = 4  # per DP rank
    recompute: str = "none"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    out = {
        "llama8": str(save_tiny("llama3", root / "llama8", num_hidden_layers=8)),
        "tied8": str(save_tiny("llama_tied", root / "tied8", num_hidden_layers=8)),
    }
    if (STORIES / "config.json").is_file():
        out["stories"] = str(STORIES)
    return out


def _global_batch(vocab: int, n: int, b: int = 2, s: int = 8) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(n)
    mbs = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, s), generator=g)
        labels = torch.randint(0, vocab, (b, s), generator=g)
        labels[:, -1] = -100
        labels[0, :2] = -100  # uneven ignored tokens across micro-batches
        mbs.append(MicroBatch(input_ids=ids, labels=labels))
    return mbs


def _hf_grads(chunk, shards_of) -> dict[str, torch.Tensor]:
    params = dict(chunk.named_parameters())
    out = {}
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process):
        # A tied lm_head copy must end up holding the whole embedding gradient: compare it as one.
        out.update(to_hf(dataclasses.replace(rule, tied=False), shards_of(params[rule.local].grad), chunk.cfg))
    return out


def _reference(folder: str, n_total: int, dtype: torch.dtype):
    """The unsharded model's loss and gradients over the global batch of `n_total` micro-batches."""
    chunk = load_chunks(HFCheckpoint(folder), make_ps(world=1), dtype=dtype)[0]
    mbs = _global_batch(chunk.cfg.vocab_size, n_total)
    num_tokens = sum(m.label_tokens() for m in mbs)
    ids = torch.cat([m.input_ids for m in mbs])
    labels = torch.cat([m.labels for m in mbs])
    loss = chunk(ids, labels=labels).sum() / num_tokens
    loss.backward()
    return [loss.item()], _hf_grads(chunk, lambda g: [g])


class _Recorder:
    """Stands between the schedule and the data-parallel wrapper: records the schedule's hook calls."""

    def __init__(self, wrapper: DataParallel):
        self.wrapper = wrapper
        self.calls: list[tuple[int, bool]] = []

    def set_last_microbatch(self, chunk: int, is_last: bool) -> None:
        self.calls.append((chunk, is_last))
        self.wrapper.set_last_microbatch(chunk, is_last)


def _references(folders: dict, cases: list[Case], world: int) -> dict:
    """The `Truth` of each (model, global batch) the cases of a `world`-rank run compare with, computed here once:
    the float64 run is the truth; the fp32 one's distance from it is what rounding does here."""
    refs = {}
    for case in cases:
        key = folders[case.model], case.microbatches * world // (case.tp * case.pp)
        if key not in refs:
            refs[key] = truth_of(*(_reference(*key, dtype) for dtype in (torch.float64, torch.float32)))
    return refs


def _run_cases(folders: dict, cases: list[Case], refs: dict) -> list[dict]:
    results = []
    for case in cases:
        ps = make_ps(tp=case.tp, pp=case.pp, vpp=case.vpp, sp=case.sp)
        folder = folders[case.model]
        chunks = load_chunks(HFCheckpoint(folder), ps, recompute=case.recompute)
        n_total = case.microbatches * ps.dp
        everything = _global_batch(chunks[0].cfg.vocab_size, n_total)
        num_tokens = sum(m.label_tokens() for m in everything)
        exact = refs[(folder, n_total)]
        (ref_loss,), ref_grads = exact.losses, exact.params
        mine = everything[ps.dp_rank * case.microbatches : (ps.dp_rank + 1) * case.microbatches]
        wrapper = DataParallel(chunks, ps, "ddp", bucket_size=40_000_000)
        recorder = _Recorder(wrapper)
        loss = forward_backward(chunks, ps, mine, schedule=case.schedule, num_tokens=num_tokens,
                                grad_sync=recorder)
        wrapper.finish_grad_sync()
        row = dict(case=case, loss_rel=None, grad_rel=0.0, names=set(), hook_ok=_hooks_ok(recorder, case),
                   rounding=exact.rounding, partial_losses=n_total)
        if loss is not None:
            total = torch.tensor(loss, dtype=torch.float64)
            if ps.dp > 1:
                dist.all_reduce(total, group=ps.dp_group)
            row["loss_rel"] = abs(total.item() - ref_loss) / abs(ref_loss)
            # forward_only gives the same loss without touching gradients.
            again = forward_backward(chunks, ps, mine, schedule=case.schedule, num_tokens=num_tokens,
                                     forward_only=True)
            row["forward_only_diff"] = abs(again - loss)
        else:
            forward_backward(chunks, ps, mine, schedule=case.schedule, num_tokens=num_tokens, forward_only=True)
        for chunk in chunks:
            for name, g in _hf_grads(chunk, lambda t: gather_tp(t, ps)).items():
                ref = ref_grads[name]
                row["grad_rel"] = max(row["grad_rel"], ((g - ref).abs().max() / ref.abs().max()).item())
                row["names"].add(name)
        row["n_ref"] = len(ref_grads)
        results.append(row)
    return results


def _hooks_ok(recorder: _Recorder, case: Case) -> bool:
    """One call per backward; is_last exactly on each chunk's final backward of the step."""
    ok = len(recorder.calls) == case.vpp * case.microbatches
    for v in range(case.vpp):
        flags = [last for c, last in recorder.calls if c == v]
        ok &= flags == [False] * (case.microbatches - 1) + [True]
    return ok


def _check(per_rank: list[list[dict]]) -> None:
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        case = row["case"]
        names = set().union(*(r["names"] for r in rows))
        assert len(names) == row["n_ref"], f"{case}: compared {len(names)} of {row['n_ref']} gradients"
        worst = max(r["grad_rel"] for r in rows)
        losses = [r["loss_rel"] for r in rows if r["loss_rel"] is not None]
        assert losses, case
        # grad_rel is max|ours - fp64| / max|fp64| per tensor (Rounding.rel_max); the loss sums the micro-batches'.
        check_within_rounding(None, worst, max(losses), row["rounding"], row["partial_losses"],
                              f"{case}: gradient rel err {worst:.2e}, loss rel err {losses}")
        for r in rows:
            if "forward_only_diff" in r:
                # the same forward on the same rank (one thread: spawn's ranks), its losses summed in the same order
                assert r["forward_only_diff"] == 0, case
        assert all(r["hook_ok"] for r in rows), f"{case}: grad_sync hooks called wrongly"


def _with_stories(folders: dict, cases: list[Case]) -> list[Case]:
    return [c for c in cases if c.model in folders]


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def _p2p_out_of_order() -> list[torch.Tensor]:
    """Rank 0 sends a gradient then an activation to rank 1, which receives them the other way round."""
    p2p, rank = P2P(num_chunks=4), dist.get_rank()
    if rank == 0:
        grad, act = torch.full((3,), 1.0), torch.full((3,), 2.0)
        pending = p2p.exchange([Transfer(grad, 1, GRADIENT, 2, 0, True)])
        pending += p2p.exchange([Transfer(act, 1, ACTIVATION, 0, 1, True)])
        for _, work in pending:
            work.wait()
        return []
    act, grad = torch.empty(3), torch.empty(3)
    p2p.exchange([Transfer(act, 0, ACTIVATION, 0, 1, False)])
    p2p.exchange([Transfer(grad, 0, GRADIENT, 2, 0, False)])
    return [act, grad]


def _peak_saved_bytes(folder: str, m: int) -> dict[str, int]:
    """This stage's peak bytes saved for backward under GPipe and 1F1B (PP=2)."""
    ps = make_ps(pp=2)
    chunks = load_chunks(HFCheckpoint(folder), ps)
    mbs = _global_batch(chunks[0].cfg.vocab_size, m)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        meter = SavedTensorMeter(chunks)
        with meter.hooks():
            forward_backward(chunks, ps, mbs, schedule=schedule, num_tokens=1)
        assert meter.live == 0, "saved activations outlived the step"
        peaks[schedule] = meter.peak
    return peaks


def _pp2_world(folders, cases, refs):
    return _p2p_out_of_order(), _run_cases(folders, cases, refs), _peak_saved_bytes(folders["llama8"], 6)


def test_pipeline_pp2(folders):
    cases = [Case("llama8", 1, 2, s, v) for s, v in SCHEDULES]
    cases += [Case("llama8", 1, 2, "1f1b", microbatches=7)]  # fewer warm-up slots than micro-batches, odd count
    cases += [Case("llama8", 1, 2, s, v, recompute=r) for s, v in SCHEDULES for r in ("full", "selective")]
    cases += [Case("stories", 1, 2, s, v) for s, v in SCHEDULES]  # 3+2 layers; interleaved 2+1+1+1
    cases += [Case("tied8", 1, 2, s, v) for s, v in (("1f1b", 1), ("interleaved", 2))]
    cases = _with_stories(folders, cases)
    results = spawn(_pp2_world, 2, folders, cases, _references(folders, cases, 2))
    act, grad = results[1][0]  # tags, not posting order, match messages between the same two ranks
    assert act.eq(2.0).all() and grad.eq(1.0).all(), (act, grad)
    _check([r[1] for r in results])
    # 1F1B keeps pp - rank micro-batches in flight on stage rank, GPipe all 6; same bytes per micro-batch.
    for rank, (_, _, peaks) in enumerate(results):
        assert peaks["1f1b"] * 6 == peaks["gpipe"] * (2 - rank), (rank, peaks)


def test_pipeline_world4(folders):
    cases = [Case("llama8", 1, 4, s, v, microbatches=8) for s, v in SCHEDULES]  # (1,4,1)
    cases += [Case("llama8", 1, 4, "interleaved", 2, microbatches=4)]  # m == pp: all warm-up
    cases += [Case("stories", 1, 4, s, microbatches=6) for s in ("gpipe", "1f1b")]  # 2+1+1+1 layers
    cases += [Case("llama8", 2, 2, "1f1b"), Case("llama8", 2, 2, "gpipe", sp=True)]  # (2,2,1)
    cases += [Case("llama8", 2, 2, "interleaved", 2, sp=True, recompute="selective")]
    cases += [Case("stories", 2, 2, "1f1b", sp=True)]
    cases += [Case("llama8", 1, 2, s, v) for s, v in SCHEDULES]  # (1,2,2)
    cases += [Case("llama8", 2, 1, "1f1b", sp=True)]  # no pipeline: the schedule degenerates to F, B, F, B
    cases += [Case("tied8", 1, 2, "1f1b", recompute="full"), Case("stories", 1, 2, "interleaved", 2)]
    cases = _with_stories(folders, cases)
    _check(spawn(_run_cases, 4, folders, cases, _references(folders, cases, 4)))


def test_pipeline_tp2_pp2_dp2(folders):
    cases = [Case("llama8", 2, 2, s, v, sp=(s != "gpipe")) for s, v in SCHEDULES]
    cases += [Case("tied8", 2, 2, "interleaved", 2, sp=True), Case("stories", 2, 2, "1f1b", sp=True)]
    cases = _with_stories(folders, cases)
    _check(spawn(_run_cases, 8, folders, cases, _references(folders, cases, 8)))
