"""Supervised fine-tuning of gpt-oss-20b with expert parallelism on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/sft_gpt_oss.py --model openai/gpt-oss-20b --data tatsu-lab/alpaca

Defaults (TP=1 x DP=8 with EP=8, seq 4096, micro-batch 4, bf16, full recompute) and their memory arithmetic
are in `hfmeg/train/recipes/sft_gpt_oss.yaml`; openai's checkpoint stores its experts in MXFP4, which hfmeg
dequantizes to bf16 as it reads them (docs/checkpoints.md); the export is the bf16 model. Any flag overrides the defaults (`--ep`, `--micro-batch-size`, ...).
`hfmeg train --recipe sft_gpt_oss ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_gpt_oss")))
