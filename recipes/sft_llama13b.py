"""Supervised fine-tuning of LLaMA-2-13B on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/sft_llama13b.py \
        --model meta-llama/Llama-2-13b-hf --data tatsu-lab/alpaca

Defaults (TP=4 x DP=2 with sequence parallelism, seq 4096, bf16, overlapped
optimizer, selective recompute) and their memory arithmetic are in
`hfmeg/train/recipes/sft_llama13b.yaml`. Any flag overrides them; on CPU the same script
runs in fp32 with gloo, e.g. with `--model ../shared/assets/models/stories260K
--data ../shared/assets/data/alpaca_en_demo.json --tp 2 --pp 2 --max-steps 40
--seq-len 256 --global-batch-size 16 --lr 3e-3 --warmup-steps 5 --eval-every 20`
(a 260K-parameter model wants a far larger learning rate and a shorter warm-up than
the 13B defaults, which would not leave their warm-up within 40 steps).
`hfmeg train --recipe sft_llama13b ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_llama13b")))
