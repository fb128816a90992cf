"""The `hfmeg` console command (`main.py`) and the subcommands that live nowhere lower: `convert.py`
(HF <-> MP shards, adapters), `reshard.py`, `verify.py`, `export.py` (a run's checkpoint to `hf/`).
`hfmeg train` and `hfmeg plan` are `train/cli.py` and `plan/cli.py`. The top of the package layering: it
may import every package and none imports it. `tools/` and `recipes/` scripts call the same functions.
"""
