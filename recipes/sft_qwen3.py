"""Supervised fine-tuning of Qwen3-8B on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/sft_qwen3.py --model Qwen/Qwen3-8B --data tatsu-lab/alpaca

Defaults (TP=2 x DP=4 with sequence parallelism, seq 4096, bf16, selective recompute) and their memory
arithmetic are in `hfmeg/train/recipes/sft_qwen3.yaml`. Any flag overrides them; `--preset cpu` sets the
sizes a tiny model wants on CPU. `hfmeg train --recipe sft_qwen3 ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_qwen3")))
