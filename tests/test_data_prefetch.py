"""Batches built ahead in a thread: same batches and states as without, exact resume, errors, shutdown;
only this DP rank's rows are built; data problems are logged once, by global rank 0."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hfmeg.data.batches as batches
from hfmeg.data import DataConfig, SourceConfig, build_data
from hfmeg.errors import DataError
from hfmeg.parallel.launch import spawn
from test_data import bad_file, char_tokenizer, write_jsonl
from test_data_batches import KEYS, mixed_config

REPO = Path(__file__).resolve().parents[1]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hfmeg-data-prefetch"]


def loader(cfg: DataConfig, dp_rank: int = 0, dp_size: int = 1):
    return build_data(cfg, char_tokenizer(), dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=1,
                      global_batch_size=4)


def test_prefetch_yields_the_same_batches_states_and_reports(tmp_path):
    cfg = mixed_config(tmp_path, seq_len=256, eval_split=2)
    plain, ahead = loader(replace(cfg, prefetch=0)), loader(replace(cfg, prefetch=3))
    states, seen = [], []
    for _ in range(6):
        a, b = next(plain), next(ahead)
        seen.append(a)
        assert a.num_tokens == b.num_tokens
        assert all(torch.equal(getattr(x, k), getattr(y, k)) for x, y in zip(a.microbatches, b.microbatches) for k in KEYS)
        # the state is the one after the batch consumed, although the thread has built more by now
        assert ahead.state_dict() == plain.state_dict() and ahead.report == plain.report
        states.append(ahead.state_dict())
    assert ahead.report.counts and ahead.step == 6
    # resuming from a state saved while batches were built ahead continues exactly
    resumed = loader(replace(cfg, prefetch=2))
    resumed.load_state_dict(json.loads(json.dumps(states[2])))
    for a in seen[3:]:
        b = next(resumed)
        assert all(torch.equal(getattr(x, k), getattr(y, k)) for x, y in zip(a.microbatches, b.microbatches) for k in KEYS)
    # and a live loader can be rewound: its thread is stopped and restarted
    ahead.load_state_dict(states[0])
    assert ahead.state_dict() == states[0] and len(prefetch_threads()) == 1
    assert torch.equal(next(ahead).microbatches[0].input_ids, seen[1].microbatches[0].input_ids)
    assert len(prefetch_threads()) == 2
    for d in (plain, ahead, resumed):
        d.close()
    assert not prefetch_threads()


def test_the_producers_error_reaches_the_consumer(tmp_path):
    allbad = write_jsonl(tmp_path / "allbad.jsonl", [{"instruction": "x"}, "{oops"])
    data = loader(DataConfig(sources=[SourceConfig(str(allbad))], prefetch=2))
    for _ in range(2):  # and again: the stream stays failed
        with pytest.raises(DataError, match="allbad.jsonl: no usable record in a whole epoch"):
            next(data)
    data.close()


def test_an_unclosed_loader_stops_its_thread():
    data = loader(DataConfig(sources=[SourceConfig(str(REPO / "data" / "sft_sample.jsonl"))], seq_len=64))
    next(data)
    assert len(prefetch_threads()) == 1
    del data
    gc.collect()
    assert not prefetch_threads()
    # a process that never closes its loader exits promptly (a stub tokenizer spares importing transformers)
    code = f"""
from types import SimpleNamespace
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from hfmeg.data import DataConfig, SourceConfig, build_data
backend = Tokenizer(models.WordLevel({{"a": 0, "<unk>": 1}}, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\\s\\S]"), "isolated")
tok = SimpleNamespace(backend_tokenizer=backend, bos_token_id=None, eos_token_id=None, pad_token_id=0)
cfg = DataConfig(sources=[SourceConfig({str(REPO / "data" / "text_sample.txt")!r}, format="text")], seq_len=64)
next(build_data(cfg, tok, dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=4))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_only_this_ranks_rows_are_built(tmp_path, monkeypatch):
    built = []
    real = batches.build_row

    def build_row(docs, *args):
        built.append([d.ids.tolist() for d in docs])
        return real(docs, *args)

    monkeypatch.setattr(batches, "build_row", build_row)
    cfg = mixed_config(tmp_path, prefetch=0)
    whole = loader(cfg)
    ref = next(whole)
    rows = list(built)
    built.clear()
    parts = [next(loader(cfg, r, 4)) for r in range(4)]
    assert built == rows  # each rank built its one row, not the four
    assert all(p.num_tokens == ref.num_tokens for p in parts)


def _log_bad_data(path: str) -> tuple[list[str], dict[str, int]]:
    """Rank r is DP rank r // 2 of DP 2 (two TP ranks each); returns what it logged and counted."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hfmeg.data").addHandler(handler)
    cfg = DataConfig(sources=[SourceConfig(path)], seq_len=64, packing=False)
    data = loader(cfg, dist.get_rank() // 2, 2)
    for _ in range(3):  # several epochs of the file: every problem recurs
        next(data)
    data.close()
    return lines, data.report.counts


def test_data_problems_are_logged_once_by_rank_0(tmp_path):
    results = spawn(_log_bad_data, 4, str(bad_file(tmp_path)))
    logged, counts = results[0]
    assert sorted(line.split("(")[1].split(")")[0] for line in logged) == sorted(counts)  # each kind once
    assert counts["malformed_json"] == 2  # the file's two malformed lines, met in every epoch: counted and logged once
    assert all(lines == [] for lines, _ in results[1:])
    assert all(c == counts for _, c in results)
