"""Supervised fine-tuning of Qwen3.5-9B on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/sft_qwen3_5.py --model Qwen/Qwen3.5-9B --data tatsu-lab/alpaca

Defaults (TP=2 x DP=4 with sequence parallelism, seq 4096, bf16, selective recompute) and their memory
arithmetic are in `hfmeg/train/recipes/sft_qwen3_5.yaml`. The multimodal checkpoint's language model is
trained and its vision tower kept as it is. Any flag overrides the defaults; Qwen3.5-MoE runs with the same
script and an `--ep` (a divisor of both the DP size and the expert count).
`hfmeg train --recipe sft_qwen3_5 ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_qwen3_5")))
