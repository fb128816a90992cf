"""tools/gpu_loan.py --tiny on the CPU: every step and every system, rows appended as measured; a crash of one step
and an error of one system leave the other rows written. No timing is asserted.

The peers (torchtitan, Megatron-Core) are not hfmeg dependencies: where one is absent its rows carry the skip reason,
and the row's hfmeg side, the rotation and the summary still run. Megatron-Core is CUDA only (its grad buffers and
schedule are), so on a CPU its row is always a skip; its SDPA attention and fused-AdamW switch are tested without it
in tests/test_peer_shims.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from helpers import STORIES
from tool_loader import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_loan.py"
# The GPU image has no `datasets`: the loan runs with it unimportable, so that an import of it anywhere fails here.
NO_DATASETS = """
import runpy, sys
class NoDatasets:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "datasets":
            raise ImportError("datasets is not on the GPU image")
sys.meta_path.insert(0, NoDatasets())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _loan(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", NO_DATASETS, str(TOOL), "--tiny", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == rows  # echoed too
    assert len({r["loan"] for r in rows}) == 1 and rows[-1]["kind"] == "done"
    return rows


def _of(rows, **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory) -> list[dict]:
    return _loan(tmp_path_factory.mktemp("loan"))


def test_tiny_runs_every_step_in_order(tiny_rows):
    tool = load_tool("gpu_loan")
    ends = _of(tiny_rows, kind="step")
    assert [r["step"] for r in ends] == list(tool.STEPS)
    assert all(r["status"] == "ok" and r["exitcode"] == 0 for r in ends), ends
    env, = _of(tiny_rows, kind="env")
    assert env["device"].startswith("cpu") and env["gemm_tflops"] > 0
    assert env["versions"]["torch"] and env["versions"]["transformers"] and "datasets" not in env["versions"]


def test_tiny_smoke_steps_every_system_once(tiny_rows):
    smoke = _of(tiny_rows, kind="smoke")
    assert Counter((r["model"], r["system"]) for r in smoke) == Counter(
        [("dense", s) for s in ("hfmeg", "transformers", "torchtitan", "megatron-core")]
        + [("moe", "hfmeg"), ("moe", "transformers")])
    for r in smoke:
        if r["system"] in ("hfmeg", "transformers"):
            assert r["loss"] > 0 and r["tokens"] > 0, r
        else:  # a peer either ran or says why not (Megatron-Core: not installed, or CUDA only)
            assert "loss" in r or r["skipped"], r
    assert _of(smoke, system="megatron-core")[0].get("skipped")
    # both systems train the same tokens from the same weights: the same first loss (fp32, toy shapes)
    for model in ("dense", "moe"):
        h, t = (_of(smoke, model=model, system=s)[0]["loss"] for s in ("hfmeg", "transformers"))
        assert h == pytest.approx(t, rel=1e-3)


@pytest.mark.parametrize("step, systems", [("row1", ("hfmeg", "transformers")),
                                           ("row2", ("hfmeg", "hfmeg-unpacked")),
                                           ("row3", ("hfmeg", "transformers")),
                                           ("row4", ("hfmeg", "hfmeg-fp8"))])
def test_tiny_rows_rotate_three_rounds_and_summarise(tiny_rows, step, systems):
    rounds = _of(tiny_rows, step=step, kind="round")
    assert Counter(r["system"] for r in rounds) == Counter({s: 3 for s in systems}) + Counter(
        {s: 3 for s in ("torchtitan",) if _of(tiny_rows, step=step, kind="round", system=s)})
    ran = list(dict.fromkeys(r["system"] for r in rounds if r["round"] == 0))
    for r in (1, 2):  # each round starts one system later
        order = [x["system"] for x in rounds if x["round"] == r]
        assert order == ran[r % len(ran):] + ran[:r % len(ran)]
    summary = {r["system"]: r for r in _of(tiny_rows, step=step, kind="row")}
    for name in ran:
        row = summary[name]
        tps = [x["tokens_per_s"] for x in rounds if x["system"] == name]
        assert row["rounds"] == 3 and row["tokens_per_s_all"] == tps and min(tps) <= row["tokens_per_s"] <= max(tps)
        anchor = summary["hfmeg" if row["packed"] else "hfmeg-unpacked"]["tokens_per_s"]
        assert row["ratio_vs_hfmeg"] == pytest.approx(row["tokens_per_s"] / anchor)
        assert row["mfu"] is None  # no peak FLOP/s for a CPU
    if step == "row3":
        assert rounds[0]["shapes"]["experts"] and rounds[0]["shapes"]["top_k"] == 2
    if step == "row2":  # Megatron-Core takes unpacked rows: the hfmeg row beside it is unpacked too
        assert summary["hfmeg-unpacked"]["packed"] is False and "unpacked" in summary["hfmeg-unpacked"]["note"]
        assert summary["hfmeg"]["packed"] is True
        assert _of(tiny_rows, step="row2", kind="row", system="megatron-core")[0]["skipped"]
        assert "torchtitan" in summary or _of(tiny_rows, step="row2", system="torchtitan")[0]["skipped"]


def test_tiny_row4_trains_fp8_beside_bf16(tiny_rows):
    """The FP8 row (emulated on the CPU) trains the same tokens from the same weights: its first loss is hfmeg's
    within FP8 rounding (e4m3 keeps 3 mantissa bits: a relative step of 2^-3 per operand, far less on a mean)."""
    rounds = {r["system"]: r for r in _of(tiny_rows, step="row4", kind="round", round=0)}
    fp8, plain = rounds["hfmeg-fp8"]["losses"][0], rounds["hfmeg"]["losses"][0]
    assert fp8 != plain and fp8 == pytest.approx(plain, rel=2**-3)
    assert "FP8" in _of(tiny_rows, step="row4", kind="row", system="hfmeg-fp8")[0]["precision"]


def test_a_crashed_step_and_a_failing_system_leave_the_other_rows(tmp_path):
    rows = _loan(tmp_path, "--steps-only", "env,row1,row4", "--inject-crash", "env",
                 "--inject-crash", "row1:transformers")
    env_end, = _of(rows, kind="step", step="env")
    assert env_end["status"] == "error" and env_end["exitcode"] != 0  # aborted: no row of its own
    assert not _of(rows, kind="env")
    error, = _of(rows, step="row1", kind="error")
    assert error["system"] == "transformers" and "injected crash" in error["error"]
    assert len(_of(rows, step="row1", kind="round", system="hfmeg")) == 3
    hfmeg, = _of(rows, step="row1", kind="row")
    assert hfmeg["system"] == "hfmeg" and hfmeg["rounds"] == 3
    assert _of(rows, kind="step", step="row1")[0]["status"] == "ok"
    assert _of(rows, step="row4", kind="row")


def test_a_step_given_less_than_its_minimum_is_skipped(tmp_path):
    tool = load_tool("gpu_loan")
    a = tool.parse_args(["--tiny", "--budget", str(tool.MIN_STEP_S / 2), "--out", str(tmp_path)])
    tool.run_steps(tool.Loan(a, tool.Rows(tmp_path / "rows.jsonl", "t")), ["row4"], tool.STEPS)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    end, = _of(rows, kind="step")
    assert end["status"] == "skipped" and "budget" in end["reason"]


def test_bad_arguments_exit_2_with_one_message(capsys):
    tool = load_tool("gpu_loan")
    for argv, flag in ((["--steps-only", "row9"], "--steps-only"), (["--rounds", "0"], "--rounds"),
                       (["--steps-only", ","], "--steps-only")):
        with pytest.raises(SystemExit) as e:
            tool.parse_args(argv)
        assert e.value.code == 2
        assert flag in capsys.readouterr().err.strip().splitlines()[-1]


def test_features_refuse_while_the_speed_run_holds_the_lock(tmp_path, monkeypatch, capsys):
    import fcntl
    tool = load_tool("gpu_loan")
    features = load_tool("loan_features")
    lock_path = tmp_path / "lock"
    monkeypatch.setattr(features, "LOCK", lock_path)
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        a = tool.parse_args(["--features", "--tiny", "--out", str(tmp_path)])
        assert features.run_features(a) == 2
    assert "still running" in capsys.readouterr().err
    assert not (tmp_path / "features.jsonl").exists()


def test_loan_table_lists_every_measured_row_and_every_skip(tiny_rows):
    text = load_tool("loan_table").table(tiny_rows)
    measured = _of(tiny_rows, kind="row")
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| row ")]
    assert len(lines) == sum("tokens_per_s" in r for r in measured)
    for r in measured:
        if "tokens_per_s" in r:
            assert any(f"| {r['system']} |" in line and f"{r['tokens_per_s']:,.0f}" in line for line in lines)
        else:
            assert f"{r['system']}: {r['skipped']}" in text
    assert text.startswith("cpu")


def test_tiny_features_call_runs_each_check_and_records_its_result(tmp_path):
    """The second call at toy shapes on the CPU: the GPU-marked tests (skipping themselves here), a family against
    transformers and DPO against TRL, each one line with its status and the check's own JSON result."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(TOOL), "--features", "--tiny", "--out", str(out)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "features.jsonl").read_text().splitlines()]
    features = load_tool("loan_features")
    assert [r["name"] for r in _of(rows, kind="feature")] == [name for name, _, _ in features.checks(tiny=True)]
    dpo, = _of(rows, name="dpo")
    if (STORIES / "config.json").is_file():
        assert dpo["result"]["by_mode"]  # bench_dpo's JSON line, kept
    else:  # DPO reads the shared assets: without them its line carries the one-line refusal, the others still run
        assert dpo["status"] == "error" and any("absent" in line for line in dpo["tail"]), dpo
    ran = [r for r in _of(rows, kind="feature") if r is not dpo or dpo["status"] == "ok"]
    assert all(r["status"] == "ok" and r["exitcode"] == 0 for r in ran), rows
    family, = _of(rows, name="family-qwen3")
    assert family["result"]["hfmeg_losses"][0] == pytest.approx(family["result"]["hf_losses"][0], rel=1e-4)
    assert rows[-1]["kind"] == "done"


def test_the_compile_cache_goes_to_out_and_comes_back_from_the_carried_folder(tmp_path, monkeypatch):
    tool = load_tool("gpu_loan")
    cache = tmp_path / "inductor"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(b"compiled" * 1000)
    monkeypatch.setattr(tool, "CACHE_DIR", cache)
    out = tmp_path / "out"
    out.mkdir()
    rows = tool.Rows(out / "rows.jsonl", "t")
    tool._pack_cache(out, rows)
    row = json.loads((out / "rows.jsonl").read_text())
    assert row["kind"] == "compile_cache" and row["kept"] and (out / "compile_cache.tar.gz").stat().st_size == row["bytes"]

    # the next loan: carried as .loan/compile_cache.tar.gz, unpacked before the first compile
    import shutil
    shutil.rmtree(cache)
    monkeypatch.setattr(tool, "CARRIED_CACHE", out / "compile_cache.tar.gz")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset")  # restored after the test
    tool._unpack_cache()
    assert (cache / "fxgraph" / "entry").read_bytes() == b"compiled" * 1000
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
