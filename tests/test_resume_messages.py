"""What a resume says it does with the folders above its resume point, and that it does it.

A kill between a checkpoint's rename and the `latest` update leaves `iter_0000006` complete while `latest`
names `iter_0000003`. `--resume auto` resumes from 3 and would save 6 again over the left one: the run sets it
aside under a name no save collides with, says so, and the folder is there afterwards, intact.
"""

from __future__ import annotations

import json

from hfmeg.parallel.launch import spawn
from hfmeg.train.checkpointing import STATE_FILE
from hfmeg.train.trainer import Trainer
from test_train import _assets, _config


def _run(cfg):
    return Trainer(cfg).run().steps


def test_a_checkpoint_left_above_latest_is_kept_aside_as_the_message_says(tmp_path, capfd):
    out = tmp_path / "run"
    cfg = _config(out, _assets(), steps=6, save_every=3, resume="auto", gbs=2)
    spawn(_run, 1, cfg)
    root = out / "checkpoints"
    left = json.loads((root / "iter_0000006" / STATE_FILE).read_text())
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")  # the kill fell before `latest` named 6
    capfd.readouterr()
    assert spawn(_run, 1, cfg) == [6]
    log = capfd.readouterr().out
    aside = root / "iter_0000006.orphan"
    assert (f"checkpoint.resume: iter_0000006 in {root} is newer than iter_0000003, where this run resumes, and not "
            f"on its timeline (a complete checkpoint, left by a run that died before latest_checkpointed_iteration.txt"
            f" named it): kept as iter_0000006.orphan, which no save of this run overwrites; resume from it with "
            f"--resume {aside}") in log, log
    assert json.loads((aside / STATE_FILE).read_text()) == left  # kept, as said, and untouched
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000003", "iter_0000006", "iter_0000006.orphan"]
    # Said once: a later resume finds nothing above its resume point and moves nothing.
    cfg.train.max_steps = 6
    spawn(_run, 1, cfg)
    assert "orphan" not in capfd.readouterr().out


def test_resuming_from_a_folder_set_aside_reads_its_step(tmp_path):
    """`--resume .../iter_0000006.orphan`, as the line suggests: newer means above its step, not above 0."""
    from hfmeg.train.checkpointing import find_resume

    root = tmp_path / "checkpoints"
    for name, step in (("iter_0000003", 3), ("iter_0000006", 6), ("iter_0000006.orphan", 6), ("iter_0000009", 9)):
        (root / name).mkdir(parents=True)
        (root / name / STATE_FILE).write_text(json.dumps({"step": step}))
    found = find_resume(root, str(root / "iter_0000006.orphan"))
    assert found.folder == root / "iter_0000006.orphan" and len(found.notes) == 1
    assert found.notes[0].startswith(f"checkpoint.resume: iter_0000009 in {root} are newer than iter_0000006.orphan")
