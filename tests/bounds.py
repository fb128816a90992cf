"""One place where the suite's numeric bounds are checked, so that measured / bound can be printed over the suite.

`within(measured, bound, what, row)` asserts measured <= bound; `assert_close` is torch.testing.assert_close that
also reports its worst |actual - expected| / (atol + rtol |expected|). With HFMEG_BOUND_REPORT=path set, each check
appends one tab-separated line `test  what  measured  bound` to that file (spawned ranks inherit the variable and
the pytest test id); unset, nothing is written. Either way the assertion is the same.

    HFMEG_BOUND_REPORT=/tmp/bounds.tsv python -m pytest -q tests/test_optim.py
    python tests/bounds.py /tmp/bounds.tsv      # worst measured/bound per (test, what), largest first
"""

from __future__ import annotations

import os
import sys

REPORT_ENV = "HFMEG_BOUND_REPORT"

# The suite's parity bounds, from the arithmetic rather than one machine: the same computation in float64 is the
# truth, and an fp32 run's own distance from it is what fp32 rounding does to this computation on this CPU. Another
# fp32 run of the same terms in another order (a layout's partial sums, another kernel's blocking, another thread
# count) rounds by as much but not the same: ROUNDING_FACTOR leaves room for that spread across layouts, CPUs and
# thread counts, and 4 eps of the value's size for results the fp32 run happens to round exactly. An error of the
# code (a missing sum, a wrong scale, a shifted position) moves a result by orders more.
ROUNDING_FACTOR = 8
FP32_EPS = 2.0 ** -23  # torch.finfo(torch.float32).eps


def rounding_bound(fp32, fp64, *, runs: int = 2) -> float:
    """The bound on max|a - b| where a and b compute what `fp64` holds (in float64) and `fp32` is one fp32 run of it:
    each fp32 run within ROUNDING_FACTOR x `fp32`'s own max-abs distance from float64 + 4 eps of the size; `runs=2`
    when two fp32 runs are compared with each other, `runs=1` when one is compared with `fp64`."""
    import torch

    fp32, fp64 = torch.as_tensor(fp32).detach().double(), torch.as_tensor(fp64).detach().double()
    rounding = (fp32 - fp64).abs().max().item()
    return runs * (ROUNDING_FACTOR * rounding + 4 * FP32_EPS * fp64.abs().max().item())


def relative_bound(fp32, fp64, *, runs: int = 2) -> float:
    """`rounding_bound` of relative distances: the bound on max |a - b| / |b| (e.g. two runs' losses step by step)
    where `fp32` is one fp32 run of what `fp64` holds, from that run's own worst relative distance from float64."""
    import torch

    ratio = torch.as_tensor(fp32, dtype=torch.float64) / torch.as_tensor(fp64, dtype=torch.float64)
    return rounding_bound(ratio, torch.ones_like(ratio), runs=runs)


def spread_bound(runs32, fp64, *, relative: bool = False) -> float:
    """The bound on max|a - b| between two fp32 computations of what `fp64` holds, given one fp32 run of each kind
    (`runs32`: e.g. hfmeg's unsharded run and transformers'): each within ROUNDING_FACTOR x that run's own max-abs
    distance from float64 + 4 eps of the size, summed. `relative`: divided by max|fp64|, as a `grad_rel` is."""
    import torch

    fp64 = torch.as_tensor(fp64).detach().double()
    size = fp64.abs().max().item()
    total = sum(ROUNDING_FACTOR * (torch.as_tensor(r).detach().double() - fp64).abs().max().item() + 4 * FP32_EPS * size
                for r in runs32)
    return total / max(size, 1e-30) if relative else total


def parity_bounds(ref32, ref64, *, runs: int = 2, partial_losses: int = 1) -> dict[str, float]:
    """Bounds, from the arithmetic, on a parity row's `logit_diff` (max-abs), `loss_diff` (abs) and `grad_rel`
    (worst over tensors of max-abs difference / max-abs of the reference) between an fp32 run and the fp32
    reference `ref32` = (logits, loss, {name: gradient}), given the same reference run in float64, `ref64`: each
    fp32 run within ROUNDING_FACTOR x the reference's own distance from float64 + 4 eps of the size (`runs=2`:
    two fp32 runs compared), the loss + 2 eps for each of the `partial_losses` fp32 partial sums it adds up."""
    (logits, loss, grads), (logits64, loss64, grads64) = ref32, ref64
    rel = max(((grads[n].double() - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in grads64.items())
    return dict(logit_diff=rounding_bound(logits, logits64, runs=runs),
                loss_diff=runs * (ROUNDING_FACTOR * abs(loss - loss64) + (4 + 2 * partial_losses) * FP32_EPS * abs(loss64)),
                grad_rel=runs * (ROUNDING_FACTOR * rel + 4 * FP32_EPS))


def report(measured: float, bound: float, what: str) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as f:  # one short write per line: concurrent ranks' lines stay whole
        f.write(f"{test}\t{what}\t{measured:.4g}\t{bound:.4g}\n")


def within(measured: float, bound: float, what: str, row=None) -> None:
    measured = float(measured)
    report(measured, bound, what)
    assert measured <= bound, (what, measured, bound, row)


def assert_close(actual, expected, *, rtol: float | None = None, atol: float | None = None, what: str = "assert_close",
                 **kw) -> None:
    import torch

    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    if rtol is None and atol is None:  # torch's defaults for the dtype, as torch.testing.assert_close picks them
        rtol, atol = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                      torch.float64: (1e-7, 1e-7)}.get(a.dtype, (0.0, 0.0))
    a, e = a.detach().cpu().double(), e.detach().cpu().double()
    if a.shape == e.shape and a.numel():
        ratio = ((a - e).abs() / (atol + rtol * e.abs())).max().item() if atol + rtol > 0 else float(
            not torch.equal(a, e))
        report(ratio, 1.0, what + (f" {kw['msg']}" if isinstance(kw.get("msg"), str) else ""))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, **kw)


def summary(path: str) -> list[tuple[str, str, float, float]]:
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    for line in open(path):
        test, what, measured, bound = line.rstrip("\n").split("\t")
        m, b = float(measured), float(bound)
        key = (test, what)
        if key not in worst or _ratio(m, b) > _ratio(*worst[key]):
            worst[key] = (m, b)
    return sorted(((t, w, m, b) for (t, w), (m, b) in worst.items()), key=lambda r: -_ratio(r[2], r[3]))


def _ratio(measured: float, bound: float) -> float:
    return measured / bound if bound else (0.0 if measured == 0 else float("inf"))


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    for test, what, m, b in summary(sys.argv[1]):
        print(f"{_ratio(m, b):8.3f}  {m:10.3g} / {b:<10.3g} {test}  [{what}]")
