"""Bad input to the converters: one clear line on stderr, exit code 2, no output, input untouched.

The command lines run in-process through each tool's `main(argv)` (the same code
path as the shell, minus the interpreter start-up).
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from convert_helpers import snapshot
from helpers import stories_or_skip
from hfmeg.checkpoint import st_stream
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from tiny_models import save_tiny
from tool_loader import load_tool



def _tool(name: str):
    return load_tool(name).main


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Path:
    """A private copy of stories260K that the tests may corrupt."""
    dst = tmp_path_factory.mktemp("src") / "stories"
    shutil.copytree(stories_or_skip(), dst)
    return dst


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fails(capsys, tool: str, argv: list[str], expect: str, inputs: list[Path], out: Path | None) -> str:
    before = {p: snapshot(p) for p in inputs if p.is_dir()}
    rc = _tool(tool)(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], err
    for p, snap in before.items():
        assert snapshot(p) == snap, f"{p} was modified"
    if out is not None:
        assert not out.exists(), f"{out} left behind"
        if out.parent.exists():
            assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary folder left"
    return lines[0]


def _to_mp(capsys, src: Path, out: Path, expect: str, *extra: str) -> str:
    argv = ["--hf", str(src), "--out", str(out), "--tp", "1", "--pp", "1", *extra]
    return _fails(capsys, "convert_hf_to_mp", argv, expect, [src], out)


def test_missing_folder_and_folder_without_weights(capsys, tmp_path, stories):
    _to_mp(capsys, tmp_path / "nope", tmp_path / "out", "no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(stories / "config.json", empty / "config.json")
    _to_mp(capsys, empty, tmp_path / "out", "no weights found")


def test_truncated_and_corrupt_safetensors(capsys, tmp_path, stories):
    trunc = _copy(stories, tmp_path / "trunc")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    _to_mp(capsys, trunc, tmp_path / "out", "model.safetensors: cannot read weights")
    bad = _copy(stories, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    _to_mp(capsys, bad, tmp_path / "out", "model.safetensors: cannot read weights")


def test_index_naming_a_missing_file(capsys, tmp_path, stories):
    sharded = tmp_path / "sharded"
    hf_to_mp(stories, tmp_path / "mp", tp=1, pp=1)
    mp_to_hf(tmp_path / "mp", sharded, max_shard_size="200KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    _to_mp(capsys, sharded, tmp_path / "out", f"names {victim.name}")


def test_shapes_disagree_with_config(capsys, tmp_path, stories):
    src = _copy(stories, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 176
    (src / "config.json").write_text(json.dumps(cfg))
    _to_mp(capsys, src, tmp_path / "out", "tensor model.layers.0.mlp.gate_proj.weight has shape [172, 64], "
                                         "config.json implies [176, 64]")


def test_unsupported_architecture(capsys, tmp_path, stories):
    src = _copy(stories, tmp_path / "neox")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))
    _to_mp(capsys, src, tmp_path / "out", "model_type")
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForSequenceClassification"]}))
    _to_mp(capsys, src, tmp_path / "out", "field architectures: 'LlamaForSequenceClassification' is not supported")


def test_tp_must_divide_heads_kv_heads_and_ffn(capsys, tmp_path, stories):
    out = tmp_path / "out"
    _to_mp(capsys, stories, out, "num_attention_heads: 8 is not divisible by TP=3", "--tp", "3")
    kv3 = save_tiny("llama3", tmp_path / "kv3", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    _to_mp(capsys, kv3, out, "num_key_value_heads: 3 is not divisible by TP=2, nor TP by it", "--tp", "2")
    ffn = save_tiny("llama3", tmp_path / "ffn", intermediate_size=130)  # 130 = 2 * 65: TP=4 cannot split it
    _to_mp(capsys, ffn, out, "intermediate_size: 130 is not divisible by TP=4", "--tp", "4")
    _to_mp(capsys, stories, out, "--vocab-multiple must be >= 1", "--vocab-multiple", "0")


def test_pp_larger_than_layers_or_bad_pp_layers(capsys, tmp_path, stories):
    out = tmp_path / "out"
    _to_mp(capsys, stories, out, "6 chunks is more than the model's 5 layers", "--pp", "6")
    _to_mp(capsys, stories, out, "--pp-layers sums to 4, but the model has 5 layers", "--pp", "2", "--pp-layers", "2,2")
    _to_mp(capsys, stories, out, "--pp-layers has 3 entries, expected PP x VPP = 2", "--pp", "2", "--pp-layers", "1,2,2")


def test_existing_output_needs_overwrite(capsys, tmp_path, stories):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(out)
    argv = ["--hf", str(stories), "--out", str(out), "--tp", "1", "--pp", "1"]
    _fails(capsys, "convert_hf_to_mp", argv, "already exists (pass --overwrite to replace it)", [stories], None)
    assert snapshot(out) == before
    assert _tool("convert_hf_to_mp")(argv + ["--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "release" / "hfmeg_layout.json").is_file()
    _fails(capsys, "reshard_mp", ["--mp", str(out), "--out", str(out / "inner"), "--tp", "2", "--pp", "1"],
           "overlaps the input", [out], out / "inner")


def _fail_after(monkeypatch, calls: int):
    """Make the safetensors writer hit a full disk on its `calls`-th write (i.e. after earlier files)."""
    original, count = st_stream.StreamingSafetensorsWriter._write_bytes, [0]

    def write(self, data):
        count[0] += 1
        if count[0] >= calls:
            raise OSError(28, "No space left on device")
        original(self, data)

    monkeypatch.setattr(st_stream.StreamingSafetensorsWriter, "_write_bytes", write)


def test_write_error_half_way_leaves_nothing(capsys, monkeypatch, tmp_path, stories):
    # At TP2 x PP2 each rank file takes ~20 writes (header + tensors): the PP-rank-0 files are complete
    # when the 60th write fails inside the PP-rank-1 files.
    _fail_after(monkeypatch, 60)
    out = tmp_path / "nested" / "out"
    _to_mp(capsys, stories, out, "No space left on device", "--tp", "2", "--pp", "2")
    assert not (tmp_path / "nested").exists()
    monkeypatch.undo()
    hf_to_mp(stories, tmp_path / "mp", tp=2, pp=2)
    _fail_after(monkeypatch, 30)
    argv = ["--mp", str(tmp_path / "mp"), "--out", str(tmp_path / "hf"), "--max-shard-size", "100KB"]
    _fails(capsys, "convert_mp_to_hf", argv, "No space left on device", [tmp_path / "mp"], tmp_path / "hf")


def test_bad_mp_inputs(capsys, tmp_path, stories):
    hf_to_mp(stories, tmp_path / "mp", tp=2, pp=1)
    _fails(capsys, "convert_mp_to_hf", ["--mp", str(tmp_path / "none"), "--out", str(tmp_path / "hf")],
           "no such folder", [], tmp_path / "hf")
    _fails(capsys, "convert_mp_to_hf", ["--mp", str(stories), "--out", str(tmp_path / "hf")],
           "not an hfmeg MP checkpoint", [stories], tmp_path / "hf")
    rank = tmp_path / "mp" / "release" / "mp_rank_01" / "model.safetensors"
    rank.write_bytes(rank.read_bytes()[:1000])
    _fails(capsys, "convert_mp_to_hf", ["--mp", str(tmp_path / "mp"), "--out", str(tmp_path / "hf")],
           "mp_rank_01/model.safetensors: cannot read weights", [tmp_path / "mp"], tmp_path / "hf")
    hf_to_mp(stories, tmp_path / "mp1", tp=1, pp=1)
    shutil.copy(tmp_path / "mp1/release/mp_rank_00/model.safetensors", tmp_path / "mp/release/mp_rank_01/model.safetensors")
    _fails(capsys, "reshard_mp", ["--mp", str(tmp_path / "mp"), "--out", str(tmp_path / "r"), "--tp", "1", "--pp", "1"],
           "mp_rank_01/model.safetensors: tensor embed.weight has shape [512, 64], the layout implies [256, 64]",
           [tmp_path / "mp"], tmp_path / "r")


class _FullDiskFile:
    """An open file on a full disk: writes fail, and so does the flush when it is closed."""

    def __init__(self, path, mode):
        self._real = open(path, mode)

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self._real.close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_whose_close_fails_too_is_one_line(capsys, monkeypatch, tmp_path, stories):
    """The writer's abort closed the file, whose flush raised a second, raw OSError (issue 18 #6)."""
    monkeypatch.setattr(st_stream, "open", _FullDiskFile, raising=False)
    line = _to_mp(capsys, stories, tmp_path / "out", "No space left on device", "--tp", "2", "--pp", "1")
    assert "mp_rank_" in line  # names the file


def test_read_only_output_storage(capsys, monkeypatch, tmp_path, stories):
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.startswith(".out.tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    _to_mp(capsys, stories, tmp_path / "out", "cannot create the output folder (Read-only file system)")


def test_an_oserror_no_layer_named_is_still_one_line(capsys, monkeypatch, tmp_path, stories):
    """E.g. the HF side files' copy (shutil) on a full disk."""
    import hfmeg.checkpoint.convert as convert

    def copy(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst / "tokenizer.json"))

    monkeypatch.setattr(convert, "copy_hf_side_files", copy)
    line = _to_mp(capsys, stories, tmp_path / "out", "No space left on device; no output written")
    assert "tokenizer.json" in line


def test_ctrl_c_in_a_converter_writes_nothing(capsys, monkeypatch, tmp_path, stories):
    mp = _mp(tmp_path, stories)
    original, count = st_stream.StreamingSafetensorsWriter._write_bytes, [0]

    def write(self, data):
        count[0] += 1
        if count[0] == 5:
            raise KeyboardInterrupt
        original(self, data)

    monkeypatch.setattr(st_stream.StreamingSafetensorsWriter, "_write_bytes", write)
    for tool, argv in (("convert_hf_to_mp", ["--hf", str(stories), "--tp", "2", "--pp", "1"]),
                       ("reshard_mp", ["--mp", str(mp), "--tp", "1", "--pp", "1"]),
                       ("convert_mp_to_hf", ["--mp", str(mp)])):
        count[0] = 0
        out = tmp_path / f"out-{tool}"
        assert _tool(tool)(argv + ["--out", str(out)]) == 130
        assert capsys.readouterr().err.strip() == "interrupted; no output written"
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]


def _mp(tmp_path: Path, stories: Path) -> Path:
    mp = tmp_path / "mp"
    if not mp.exists():
        hf_to_mp(stories, mp, tp=2, pp=1)
    return mp


def test_converters_say_what_they_wrote(capsys, tmp_path, stories):
    assert _tool("convert_hf_to_mp")(["--hf", str(stories), "--out", str(tmp_path / "mp"), "--tp", "2",
                                      "--pp", "1"]) == 0
    verified, wrote = capsys.readouterr().out.strip().splitlines()  # to-mp checks its first layers first
    assert verified.startswith("verified: the first 2 layers' logits are transformers' within ")
    assert wrote == f"wrote {tmp_path / 'mp'}: 8 files (2 safetensors, 1.18 MB), 1.20 MB in all"
    assert _tool("reshard_mp")(["--mp", str(tmp_path / "mp"), "--out", str(tmp_path / "r"), "--tp", "1",
                                "--pp", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'r'}: 7 files (1 safetensors, ")
    assert _tool("convert_mp_to_hf")(["--mp", str(tmp_path / "r"), "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'hf'}: 5 files (1 safetensors, ")
