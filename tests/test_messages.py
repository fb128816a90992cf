"""What a newcomer's mistakes read like: a mistyped flag named with the close one, no abbreviations, every layout
problem at once."""

from __future__ import annotations

import pytest

from hfmeg.train import cli

SFT = cli.recipe_config("sft_llama13b")
BASE = ["--model", "no/model", "--data", "no-data.json", "--out", "never-written"]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("argv, expect", [
    (["--max-step", "5"], "error: unknown flag --max-step; did you mean --max-steps?"),  # not --max-steps 5
    (["--max-stesp=5"], "error: unknown flag --max-stesp; did you mean --max-steps?"),
    (["--warmup", "2"], "error: unknown flag --warmup; did you mean --warmup-steps?"),
    (["--zzzz", "1"], "error: unknown flag --zzzz"),
])
def test_a_mistyped_flag_is_named_with_the_close_one(capsys, argv, expect):
    with pytest.raises(SystemExit) as e:
        cli.main("test", SFT, BASE + argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(expect)


def test_hfmeg_train_takes_no_value_of_a_mistyped_flag_for_its_config(capsys):
    with pytest.raises(SystemExit):
        cli.main("test", None, ["--recipe", "sft_llama13b", "--max-step", "5"], prog="hfmeg train")
    err = capsys.readouterr().err
    assert "unknown flag --max-step; did you mean --max-steps?" in err and "not allowed with" not in err


def test_every_layout_problem_is_reported_at_once(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert cli.main("test", SFT, BASE + ["--tp", "3", "--global-batch-size", "7"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert lines == ["error: data.seq_len: the 4096 tokens of each CP rank (sequence length 4096 / CP=1) do not "
                     "divide over TP=3 (sequence parallelism)",
                     "error: train.global_batch_size: global batch 7 is not divisible by DP x micro-batch = 2 x 1"]


def test_verify_on_a_lora_checkpoint_and_export_of_a_run_without_one_say_what_they_were_given(tmp_path, capsys):
    from hfmeg.checkpoint.mp_layout import LAYOUT_FILE
    from hfmeg.commands import export, verify

    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000005"
    (ckpt / "mp_rank_00").mkdir(parents=True)
    (ckpt / LAYOUT_FILE).write_text("{}")
    (ckpt / "mp_rank_00" / "adapter.safetensors").write_bytes(b"")
    assert verify.main(["--mp", str(ckpt), "--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt}: a LoRA/DoRA training checkpoint (adapter shards on a frozen base, no model weights)" in err
    assert "`hfmeg export OUT`" in err and "missing rank file" not in err
    live = tmp_path / "live"
    live.mkdir()
    (live / "config.yaml").write_text("train: {}\n")
    assert export.main([str(live)]) == 2
    assert f"{live}: a training run's --out with no checkpoint yet" in capsys.readouterr().err
