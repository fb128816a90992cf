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
