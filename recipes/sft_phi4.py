"""Supervised fine-tuning of Phi-4 (14B) on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/sft_phi4.py --model microsoft/phi-4 --data tatsu-lab/alpaca

Defaults (TP=2 x PP=2 x DP=2 with sequence parallelism, seq 4096, bf16, selective recompute) and their memory
arithmetic are in `hfmeg/train/recipes/sft_phi4.yaml`. Any flag overrides them; `--preset cpu` sets the
sizes a tiny model wants on CPU. `hfmeg train --recipe sft_phi4 ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_phi4")))
