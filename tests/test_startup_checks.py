"""A run whose inputs are bad fails at start-up in one line, exit 2, and leaves `--out` as it was.

Each case runs `hfmeg train` in this process as a world of one (the checks run on every rank alike and are
agreed, so one rank shows the whole behaviour): the model's config through the guarded load, every data
source opened and its first records read, `bad_data: fail` over the first window, all before the lock.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from hfmeg.train.cli import train_command
from test_train import ALPACA, _assets


def _records(n: int) -> list[dict]:
    return json.loads(ALPACA.read_text())[:n]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _relabelled(tmp_path, model, model_type: str) -> str:
    folder = tmp_path / f"model_{model_type}"
    shutil.copytree(model, folder)
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return str(folder)


def _damaged_parquet(tmp_path) -> str:
    path = tmp_path / "part-0.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 64)  # a header and no footer: a copy cut short
    return str(path)


def _bad_third_record(tmp_path) -> str:
    records = _records(8)
    records[2] = {"instruction": "a record with no output"}
    return _jsonl(tmp_path / "bad.jsonl", records)


# case -> (model, data, extra flags, the line's expected text) given tmp_path and the good model
CASES = {
    "damaged parquet": lambda t, m: (m, _damaged_parquet(t), [],
                                     f"{t / 'part-0.parquet'}: not a readable Parquet file (Parquet magic bytes"),
    "relabelled model_type": lambda t, m: (_relabelled(t, m, "falcon"), str(ALPACA), [],
                                           f"{t / 'model_falcon' / 'config.json'} field head_dim: does not fit "
                                           "model_type 'falcon'"),
    "unknown model_type": lambda t, m: (_relabelled(t, m, "nosuchmodel"), str(ALPACA), [],
                                        f"{t / 'model_nosuchmodel' / 'config.json'} field model_type: 'nosuchmodel' "
                                        "is not a model type"),
    "empty file": lambda t, m: (m, _jsonl(t / "empty.jsonl", []), [], f"data source {t / 'empty.jsonl'}: no records"),
    "bad_data=fail": lambda t, m: (m, _bad_third_record(t), ["--set", "data.bad_data=fail"],
                                   f"{t / 'bad.jsonl'}:3: "),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_is_one_line_exit_2_and_out_unchanged(case, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    model, data, extra, expected = CASES[case](tmp_path, _assets())
    out = tmp_path / "runs" / "run"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("the user's own file\n")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    code = train_command(["--recipe", "sft_llama13b", "--model", str(model), "--data", data, "--tp", "1",
                          "--seq-len", "64", "--set", "data.overlong=split", "--global-batch-size", "2",
                          "--micro-batch-size", "1", "--max-steps", "2", "--warmup-steps", "0",
                          "--report-to", "none", "--dtype", "fp32", "--out", str(out), *extra])
    captured = capfd.readouterr()
    errors = [line for line in (captured.out + captured.err).splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {expected}"), (code, captured)
    assert "Traceback" not in captured.err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # no lock, config, hf_source, metrics


def test_an_unreachable_hub_dataset_is_one_line_before_the_model_loads(tmp_path, capfd, monkeypatch):
    """No network (an endpoint that refuses): one probe, no retries; the bound is the probe's timeout (the
    refusal itself is immediate), well inside issue 45's 10 s."""
    from huggingface_hub import constants

    from hfmeg.checkpoint.hub_source import PROBE_TIMEOUT_S
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    out = tmp_path / "run"
    started = time.monotonic()
    code = train_command(["--recipe", "sft_llama13b", "--model", str(_assets()), "--data", "tatsu-lab/alpaca",
                          "--tp", "1", "--max-steps", "2", "--report-to", "none", "--out", str(out)])
    took = time.monotonic() - started
    captured = capfd.readouterr()
    errors = [line for line in (captured.out + captured.err).splitlines() if line.startswith("error:")]
    assert code == 2 and errors == ["error: data source tatsu-lab/alpaca: a Hub dataset, and 127.0.0.1 cannot be "
                                    "reached (Connection refused); set HF_HUB_OFFLINE=1 to use the cache alone"], captured
    assert took < PROBE_TIMEOUT_S + 5, took  # the probe, and the config checks before it
    assert not out.exists()


def test_an_uncached_hub_dataset_under_hf_hub_offline_is_one_line_before_the_model_loads(tmp_path, capfd,
                                                                                       monkeypatch):
    """HF_HUB_OFFLINE=1 and a Hub dataset the cache lacks: no network asked, one line naming the source and the
    setting, `--out` not created (issue 45: offline Hub data fails in seconds)."""
    from huggingface_hub import constants

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)  # datasets' own copy, read when it was imported
    out = tmp_path / "run"
    code = train_command(["--recipe", "sft_llama13b", "--model", str(_assets()), "--data", "tatsu-lab/alpaca",
                          "--tp", "1", "--max-steps", "2", "--report-to", "none", "--out", str(out)])
    captured = capfd.readouterr()
    errors = [line for line in (captured.out + captured.err).splitlines() if line.startswith("error:")]
    assert code == 2 and errors == ["error: data source tatsu-lab/alpaca:train: not in the local cache, and "
                                    "HF_HUB_OFFLINE is set (the Hub is not asked); unset it to download, or give a "
                                    "local file"], captured
    assert not out.exists()
