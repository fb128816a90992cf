"""Supervised fine-tuning of Gemma 3 12B on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/sft_gemma3.py --model google/gemma-3-12b-pt --data tatsu-lab/alpaca

Defaults (TP=4 x DP=2 with sequence parallelism, seq 4096, bf16, selective recompute) and their memory
arithmetic are in `hfmeg/train/recipes/sft_gemma3.yaml`. Any flag overrides them; `--preset cpu` sets the
sizes a tiny model wants on CPU. `hfmeg train --recipe sft_gemma3 ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_gemma3")))
