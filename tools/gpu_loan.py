"""The one command a GPU loan runs first: the speed rows, each written to $OUT the moment it is measured.

A loan is 15 minutes of device time (the machine's start included), one command at most 10. This script fits one
call: `--budget` seconds of wall time (540 by default), spent on steps in priority order, each given the smaller of
its own limit and what is left:

1. `env`: versions (read from the installed metadata, nothing imported but torch), device, and the bf16 GEMM ceiling
   (an 8192-cube matmul timed; on the CPU a small fp32 one);
2. `smoke`: one training step of every system at toy shapes, so that a system that cannot run costs seconds;
3. `row1`: the trainer path at LLaMA-2-7B layer shapes (16 layers, seq 4096, bf16, packed documents): hfmeg against
   transformers (SDPA; it finds the documents from the rows' position_ids);
4. `row2`: torchtitan and Megatron-Core at the same shapes and batch, beside hfmeg; a peer that cannot take packed
   documents (Megatron-Core without Transformer Engine) trains unpacked rows, and its row says so, and an unpacked
   hfmeg row is measured beside it;
5. `row3`: a Mixtral-shaped MoE (2 layers of 8 experts of FFN 14336, top-2) against transformers;
6. `row4`: hfmeg with its linears in FP8 (torchao tensorwise, `model.fp8`) against hfmeg in bf16, the trainer path
   at the 7B layer shapes (the goal: tokens/s >= 1.3x bf16; each round row carries its losses).

Each step runs in a forked child under its limit: a crash, a hang or an OOM of one step is one `error` row, and the
steps after it still run. Inside a step every system is built under its own guard, so a system that fails is a row
carrying its error beside the others. Rows are measured in rounds (`--rounds`, 3), the systems' order rotated by
one each round; every timed window is a `round` line as soon as it ends, and each system's `row` line (median
tokens/s and MFU over its rounds, its ratio to hfmeg's row on the same rows) follows the step's last round.
Resident mode: where the systems' parameters, gradients and optimizer states fit the device together, each is built
once and only the timed windows rotate; otherwise (or on an out-of-memory while building) each round builds, times
and frees every system in turn.

Output, in `--out` (default `$OUT`, else `out/loan`): `rows.jsonl` (every line JSON: `env`, `smoke`, `round`, `row`,
`error`, `step`), and `compile_cache.tar.gz` (Inductor's cache, for the next loan: carry it as
`.loan/compile_cache.tar.gz`, where it is unpacked before the first compile). The log is the command's output.

`--features` is the second, separate call (after this one has returned): the GPU-marked tests, each family's tokens/s
against transformers and DPO against TRL, rows in `features.jsonl`. `--tiny` runs the whole script, every step and
every system, on the CPU at toy shapes in about 20 s of CPU time (tests/test_gpu_loan.py). How a loan is run:
docs/gpu.md.

    python tools/gpu_loan.py                    # on the lent GPU, first call
    python tools/gpu_loan.py --features         # second call, if time is left
    python tools/gpu_loan.py --tiny --out /tmp/loan
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = Path("/tmp/hfmeg_loan_inductor")  # Inductor's cache for the run (packed into --out at the end)
CARRIED_CACHE = REPO / ".loan" / "compile_cache.tar.gz"
WHEELS = REPO / ".whl"  # tools/peer_wheels.sh's, carried to the device
SITE = Path("/tmp/hfmeg_loan_site")  # where they are installed there (--target: the image's packages untouched)
CACHE_LIMIT = 16 * 2**20  # the largest file a device call brings back
LOCK = Path("/tmp/hfmeg_loan.lock")  # held by the speed run; --features refuses to start beside it
PACKAGES = ("torch", "triton", "transformers", "torchtitan", "megatron-core", "transformer-engine", "apex", "torchao",
            "safetensors", "numpy")
MIN_STEP_S = 5.0  # a step given less is skipped, not started


@dataclass(frozen=True)
class Row:
    """One row of measurements: systems trained on the same tokens, timed in rotated rounds."""
    name: str
    systems: tuple[str, ...]  # bench_peers system names; a system that cannot take packed rows gets hfmeg beside it
    shapes: dict = field(default_factory=dict)  # overrides of the 7B layer shapes (the Mixtral's)


ROWS = {
    "row1": Row("row1", ("hfmeg", "transformers")),
    "row2": Row("row2", ("hfmeg", "torchtitan", "megatron-core")),
    "row3": Row("row3", ("hfmeg", "transformers"), dict(layers=2, ffn=14336, experts=8, top_k=2)),
    "row4": Row("row4", ("hfmeg", "hfmeg-fp8")),
}
# Step limits (s) in priority order (--tiny keeps them: its toy shapes end far inside them, on a loaded CPU too).
STEPS = {"env": 30, "smoke": 90, "row1": 170, "row2": 200, "row3": 120, "row4": 120}
BYTES_PER_PARAM = {"hfmeg": 18, "transformers": 8, "torchtitan": 16, "megatron-core": 18}  # weights+grads+Adam


# --- output ------------------------------------------------------------------------------------------------------

class Rows:
    """Appends JSON lines to rows.jsonl (shared by the parent and its step children: one write per line, flushed and
    synced, so a line is either whole or absent whatever kills the process after it) and echoes them."""

    def __init__(self, path: Path, loan: str):
        self.path, self.loan = path, loan

    def write(self, **row) -> dict:
        row = {"loan": self.loan, **row}
        line = json.dumps(row, default=str) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        print(line, end="", flush=True)
        return row


@dataclass
class Loan:
    """What every step of one run shares."""
    a: argparse.Namespace
    rows: Rows
    deadline: float = 0.0  # this step's, time.monotonic()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def crash(self, step: str, system: str | None = None) -> None:
        """The test hook (`--inject-crash STEP` / `STEP:SYSTEM`): a hard crash of the step, or a system's error."""
        if system is None and step in self.a.inject_crash:
            os.abort()  # as a segfault or a CUDA abort would: no Python cleanup, no error row from the child
        if system is not None and f"{step}:{system}" in self.a.inject_crash:
            raise RuntimeError(f"injected crash of {system} in {step}")


# --- steps (each runs in a forked child) ----------------------------------------------------------------------------

def step_env(loan: Loan) -> None:
    import torch
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = _device(loan.a)
    row = dict(step="env", kind="env", python=platform.python_version(), versions=versions,
               cuda=torch.version.cuda, hfmeg_commit=_commit(), device=_device_name(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        row.update(memory_bytes=props.total_memory, sm_count=props.multi_processor_count)
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    row.update(gemm_n=n, gemm_dtype=str(dtype).removeprefix("torch."), gemm_tflops=_gemm_tflops(n, dtype, device))
    from hfmeg.plan.flops import peak_flops
    peak = peak_flops(device)
    row.update(peak_tflops=peak / 1e12 if peak else None,
               gemm_of_peak=row["gemm_tflops"] * 1e12 / peak if peak else None)
    loan.rows.write(**row)


def _gemm_tflops(n: int, dtype, device) -> float:
    """The best of a few timed n^3 matmuls: what this device's dense GEMMs reach, the ceiling for MFU."""
    import torch
    x = torch.randn(n, n, dtype=dtype, device=device)
    y = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            x @ y
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * n**3 / best / 1e12


def step_smoke(loan: Loan) -> None:
    """One step of every system (and the MoE of row 3) at toy shapes on the device, uncompiled."""
    for row_name, systems, shapes in (("dense", ("hfmeg", "transformers", "torchtitan", "megatron-core"), {}),
                                      ("moe", ("hfmeg", "transformers"), dict(experts=4, top_k=2))):
        a = _bench_args(loan.a, dict(_tiny_shapes(), **shapes, steps=1, warmup=0), compile=False)
        benches = _benches(a, packed=True)
        for name in systems:
            system = _system(name)
            b = benches[system.packed]
            row = dict(step="smoke", kind="smoke", system=name, model=row_name, packed=system.packed)
            t0 = time.perf_counter()
            try:
                reason = system.unavailable(b)
                if reason:
                    loan.rows.write(**row, skipped=reason)
                    continue
                loan.crash("smoke", name)
                step = system.build(b)
                loss, tokens = step(0)
                _sync(b.device)
                loan.rows.write(**row, loss=loss, tokens=tokens, seconds=time.perf_counter() - t0)
            except Exception as e:  # the system's error is its row; the others still run
                loan.rows.write(**row, error=_error(e))
            finally:
                step = None
                _free(b.device)


def step_row(loan: Loan, row: Row) -> None:
    import torch
    a = _bench_args(loan.a, _tiny_moe(row.shapes) if loan.a.tiny else row.shapes)
    benches = _benches(a, packed=True)
    entries = []  # (label, system, bench)
    for name in row.systems:
        system = _system(name)
        entries.append((name, system, benches[system.packed]))
        if not system.packed and not any(lbl == "hfmeg-unpacked" for lbl, _, _ in entries):
            entries.append(("hfmeg-unpacked", _system("hfmeg"), benches[False]))
    info = dict(step=row.name, device=_device_name(benches[True].device), dtype=str(benches[True].dtype),
                shapes=benches[True].shapes)
    live, results, errors = [], {}, {}
    for label, system, b in entries:
        reason = system.unavailable(b)
        if reason:
            loan.rows.write(**info, kind="row", system=label, skipped=reason)
        else:
            live.append((label, system, b))
            results[label] = []
    resident = _fits(live, benches[True])
    built: dict[str, object] = {}
    if resident:
        for label, system, b in live:
            try:
                loan.crash(row.name, label)
                built[label] = system.build(b)
            except torch.cuda.OutOfMemoryError:
                built.clear()
                _free(b.device)
                resident = False
                break
            except Exception as e:
                errors[label] = _error(e)
                loan.rows.write(**info, kind="error", system=label, error=errors[label])
    order = [e for e in live if e[0] not in errors]
    windows = {label: 0 for label, _, _ in order}
    last_round = 0.0  # the previous round's seconds (the first includes building and compiling: an over-estimate)
    for r in range(a.rounds if order else 0):
        if r and loan.left() < 1.2 * last_round + 2:
            break  # another round would not end in time: keep the summary instead
        round_start = time.monotonic()
        for label, system, b in order[r % len(order):] + order[:r % len(order)]:
            if label in errors:
                continue
            t0 = time.monotonic()
            try:
                try:
                    if not resident:
                        loan.crash(row.name, label)
                    step = built[label] if resident else system.build(b)
                    res = _window(step, b, warmup=a.warmup if windows[label] == 0 else min(1, a.warmup), offset=r)
                except torch.cuda.OutOfMemoryError:
                    if not resident:
                        raise
                    # the estimate let everything stay resident, the activations did not fit: rebuild from here on
                    step, resident = None, False
                    built.clear()
                    _free(b.device)
                    step = system.build(b)
                    res = _window(step, b, warmup=a.warmup, offset=r)
                res["resident"] = resident
                windows[label] += 1
            except Exception as e:
                errors[label] = _error(e)
                loan.rows.write(**info, kind="error", system=label, round=r, error=errors[label])
                built.pop(label, None)
                continue
            finally:
                if not resident:
                    step = None
                    _free(b.device)
            results[label].append(res)
            loan.rows.write(**info, kind="round", system=label, round=r, tokens_per_s=res["tokens"] / res["seconds"],
                            window_s=time.monotonic() - t0, **res)
        last_round = time.monotonic() - round_start
    built.clear()
    _summarise(loan, info, order, results, errors, benches, a)


def _summarise(loan, info, order, results, errors, benches, a) -> None:
    from hfmeg.families import model_config_from_hf
    from hfmeg.plan.flops import mfu, peak_flops
    from bench_mfu import hf_config
    cfg = model_config_from_hf(hf_config(benches[True].shapes))
    peak = peak_flops(benches[True].device)
    medians = {label: statistics.median(r["tokens"] / r["seconds"] for r in results[label])
               for label, _, _ in order if results[label]}
    for label, system, b in order:
        if label not in medians:
            continue  # its error row stands
        tps = [r["tokens"] / r["seconds"] for r in results[label]]
        anchor = medians.get("hfmeg" if b.a.trainer_path else "hfmeg-unpacked")  # hfmeg on the same rows
        # a resident window's peak counts every resident system's state: only rebuilt windows give a system's own
        mems = [r["peak_mem_bytes"] for r in results[label] if r["peak_mem_bytes"] is not None and not r["resident"]]
        loan.rows.write(
            **info, kind="row", system=label, version=_version(system.package), packed=b.a.trainer_path,
            precision=system.precision(b), settings=system.settings(b), rounds=len(tps),
            tokens_per_s=medians[label], tokens_per_s_all=tps,
            mfu=mfu(cfg, medians[label], a.seq, peak, 1) if peak else None,
            peak_mem_bytes=max(mems) if mems else None, error=errors.get(label),
            ratio_vs_hfmeg=medians[label] / anchor if anchor else None,
            note=None if b.a.trainer_path else "unpacked rows: this system cannot take packed documents here; "
                                                "compare with hfmeg-unpacked")


def _window(step, b, warmup: int, offset: int) -> dict:
    """`warmup` untimed steps, then `steps` timed ones, between device syncs; the device's peak memory over the
    timed steps (with resident systems, theirs included)."""
    import torch
    n = len(b.batches)
    for i in range(warmup):
        step((offset + i) % n)
    _sync(b.device)
    if b.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(b.device)
    t0 = time.perf_counter()
    losses, tokens = [], 0
    for i in range(b.a.steps):
        loss, t = step((offset + warmup + i) % n)
        losses.append(loss)
        tokens += t
    _sync(b.device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(b.device) if b.device.type == "cuda" else None
    return dict(seconds=seconds, tokens=tokens, losses=losses, peak_mem_bytes=peak)


def _fits(live, b) -> bool:
    """Resident mode: every system's parameters, gradients and optimizer state at once, plus the largest one's
    activations (34 s h bytes a layer with flash attention, and fp32 logits and their gradient), in 90 % of the
    device. Always on the CPU."""
    if b.device.type != "cuda" or len(live) < 2:
        return True
    import torch
    sh = b.shapes
    params = _param_count(sh)
    tokens = sh["micro_batch_size"] * sh["seq"]
    activations = 34 * tokens * sh["hidden"] * sh["layers"] + 8 * tokens * sh["vocab"]
    need = sum(BYTES_PER_PARAM.get(s.name, 18) * params for _, s, _ in live) + activations
    return need <= 0.9 * torch.cuda.get_device_properties(b.device).total_memory


def _param_count(shapes: dict) -> int:
    import torch
    from bench_mfu import hf_config
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shapes))
    return sum(p.numel() for p in model.parameters())


# --- shared set-up ------------------------------------------------------------------------------------------------

def _device(a):
    import torch
    return torch.device("cuda", 0) if (torch.cuda.is_available() and not a.tiny) else torch.device("cpu")


def _device_name(device) -> str:
    import torch
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"


def _tiny_shapes() -> dict:
    from bench_mfu import TINY
    return dict(TINY)


def _tiny_moe(shapes: dict) -> dict:
    """--tiny keeps a row's MoE-ness (experts, top-k) at the toy shapes."""
    return {k: shapes[k] for k in ("experts", "top_k") if k in shapes}


def _bench_args(la, shapes: dict, compile: bool | None = None) -> argparse.Namespace:
    """The bench flags one row runs with: 7B layer shapes on a GPU (the row's overrides on top), toy ones --tiny."""
    from bench_mfu import SEVEN_B
    a = dict(SEVEN_B, steps=la.steps, warmup=la.warmup)
    if la.tiny:
        a.update(_tiny_shapes(), steps=1, warmup=1)
    if la.layers and "layers" not in shapes and not la.tiny:
        a["layers"] = la.layers
    a.update(shapes)
    a.setdefault("experts", None)
    a.setdefault("top_k", None)
    return argparse.Namespace(**a, tiny=la.tiny, compile=compile, dtype=None, peak_tflops=None, seed=0,
                              trainer_path=True, recompute="none", hf_compile=False, rounds=la.rounds)


def _benches(a, packed: bool) -> dict:
    """The Bench of packed rows (True) and of unpacked ones (False), on the same weights."""
    from bench_mfu import make_batches, settings, hf_config
    from bench_peers import Bench, _init_world_of_one
    from hfmeg.checkpoint.tensor_source import TensorSource
    from hfmeg.models.random_init import random_hf_model
    device = _device(a)
    dtype, shapes = settings(a, device)
    # initialised on the device (seconds, where 3.5 B parameters take minutes on CPU cores), kept on the CPU
    model = random_hf_model(hf_config(shapes), seed=a.seed, dtype=dtype, device=device)
    source = TensorSource.snapshot(model)
    del model
    _free(device)
    _init_world_of_one(device)
    out = {}
    for p in (True, False):
        ap = argparse.Namespace(**{**vars(a), "trainer_path": p})
        out[p] = Bench(ap, device, dtype, shapes, make_batches(ap, device), source)
    return out


def _system(name: str):
    from bench_peers import HFMEG_FP8, SYSTEMS
    return next(s for s in (*SYSTEMS, HFMEG_FP8) if s.name == name)


def _version(package: str | None) -> str | None:
    if package is None:
        return _commit()
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _sync(device) -> None:
    from bench_mfu import _sync as sync  # imported late: the repository is on the path only once main() runs
    sync(device)


def _free(device) -> None:
    from bench_mfu import _free as free
    free(device)


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


# --- the run --------------------------------------------------------------------------------------------------------

def _run_step(loan: Loan, name: str) -> None:
    """The child's body: one step; an exception is its error row (a hard crash leaves that to the parent)."""
    loan.crash(name)
    try:
        if name == "env":
            step_env(loan)
        elif name == "smoke":
            step_smoke(loan)
        else:
            step_row(loan, ROWS[name])
    except BaseException as e:
        loan.rows.write(step=name, kind="error", error=_error(e))
        raise


def _child(loan: Loan, name: str) -> None:
    try:
        _run_step(loan, name)
    except BaseException:
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown of the inherited state (process groups, CUDA)


def run_steps(loan: Loan, names: list[str], limits: dict[str, float]) -> None:
    """Each step in a forked child under min(its limit, what is left of the budget); one row for how it ended."""
    import torch
    end = time.monotonic() + loan.a.budget
    ctx = multiprocessing.get_context("fork")  # the parent never touches CUDA: each child initialises its own
    for name in names:
        if torch.cuda.is_initialized():
            raise RuntimeError("gpu_loan: CUDA was initialised in the parent; its forked steps could not use it")
        left = end - time.monotonic()
        if left < MIN_STEP_S:
            loan.rows.write(step=name, kind="step", status="skipped", reason=f"budget spent ({left:.0f} s left)")
            continue
        limit = min(limits[name], left)
        loan.deadline = time.monotonic() + limit
        t0 = time.monotonic()
        proc = ctx.Process(target=_child, args=(loan, name))
        proc.start()
        proc.join(limit)
        status = "ok"
        if proc.is_alive():
            proc.kill()
            proc.join()
            status = "timeout"
        elif proc.exitcode != 0:
            status = "error"
        loan.rows.write(step=name, kind="step", status=status, exitcode=proc.exitcode,
                        seconds=round(time.monotonic() - t0, 2), limit_s=round(limit, 2))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_loan", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="every step and system on the CPU at toy shapes")
    p.add_argument("--features", action="store_true", help="the second call: GPU-marked tests, families, DPO")
    p.add_argument("--out", type=Path, default=None, help="default: $OUT, else out/loan")
    p.add_argument("--budget", type=float, default=None, help="wall seconds in all (default 540)")
    p.add_argument("--steps-only", default=None, metavar="STEP,...", help=f"a subset of {','.join(STEPS)}")
    p.add_argument("--rounds", type=int, default=3, help="rotated rounds per row (at least 1)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per window")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before a system's first window")
    p.add_argument("--layers", type=int, default=None, help="7B-shape layers of rows 1-2 (default 16)")
    p.add_argument("--inject-crash", action="append", default=[], metavar="STEP[:SYSTEM]", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out = a.out or Path(os.environ.get("OUT") or "out/loan")
    a.budget = 540.0 if a.budget is None else a.budget
    names = list(STEPS) if a.steps_only is None else [s.strip() for s in a.steps_only.split(",") if s.strip()]
    unknown = [s for s in names if s not in STEPS]
    if unknown or not names:
        p.error(f"--steps-only: unknown {','.join(unknown) or '(none given)'}; choose from {','.join(STEPS)}")
    a.names = names
    for flag in ("rounds", "steps"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    if a.warmup < 0:
        p.error("--warmup must be at least 0")
    return a


def _install_wheels() -> None:
    """The carried wheels into SITE, first on the path of this process and of every child (pip itself reaches no
    index: --no-index, --no-deps; each wheel is pinned by tools/peer_wheels.sh)."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels and not SITE.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(SITE), *map(str, wheels)], check=True)
    if SITE.exists():
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))


def _unpack_cache() -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE_DIR)
    if CARRIED_CACHE.is_file() and not CACHE_DIR.exists():
        with tarfile.open(CARRIED_CACHE) as tar:
            tar.extractall(CACHE_DIR.parent, filter="data")


def _pack_cache(out: Path, rows: Rows) -> None:
    """Inductor's cache into out/compile_cache.tar.gz when it fits what a call brings back."""
    if not CACHE_DIR.is_dir():
        return
    raw = sum(f.stat().st_size for f in CACHE_DIR.rglob("*") if f.is_file())
    if raw > 8 * CACHE_LIMIT:  # would not compress to 16 MiB; packing it would only spend the call's last seconds
        rows.write(kind="compile_cache", kept=False, raw_bytes=raw, reason="too large to return")
        return
    target = out / "compile_cache.tar.gz"
    with tarfile.open(target, "w:gz", compresslevel=1) as tar:
        tar.add(CACHE_DIR, arcname=CACHE_DIR.name)
    size = target.stat().st_size
    if size > CACHE_LIMIT:
        target.unlink()
        rows.write(kind="compile_cache", kept=False, bytes=size, reason="over the 16 MiB a device call returns")
    else:
        rows.write(kind="compile_cache", kept=True, bytes=size, path=str(target))


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "tools"))
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() without touching the driver
    if not a.tiny:  # --tiny (the CPU suite) uses what is installed: the wheels are the GPU machine's Python's
        _install_wheels()
    if a.features:
        from loan_features import run_features
        return run_features(a)
    lock = open(LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not a.tiny:
        _unpack_cache()
    rows = Rows(a.out / "rows.jsonl", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    import torch  # noqa: F401  (imported once here: every forked step inherits it)
    import bench_peers  # noqa: F401
    run_steps(Loan(a, rows), a.names, STEPS)
    if not a.tiny:
        _pack_cache(a.out, rows)
    rows.write(kind="done", out=str(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
