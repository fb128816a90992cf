"""Preference tuning (DPO) of an SFT'd LLaMA-3-8B on one node of 8 x 80 GB GPUs.

    accelerate launch --num_processes 8 recipes/dpo_llama.py \
        --model my-org/llama3-8b-sft --data my-org/preference-pairs
    torchrun --nproc-per-node 8 recipes/dpo_llama.py --model ... --data ... --loss-type ipo --beta 0.5

Defaults (DPO's sigmoid loss at beta 0.1, TP=2 x DP=4 with sequence parallelism, pairs packed in rows
of 4096 tokens, bf16, a frozen reference copy laid out like the policy) and their memory arithmetic
are in `hfmeg/train/recipes/dpo_llama.yaml`; `--peft lora` trains adapters against the base with
them switched off (no reference copy). Any flag overrides them; on CPU the same script runs in fp32
with gloo, e.g. with `--model ../shared/assets/models/stories260K --data
../shared/assets/data/dpo_en_demo.json --format sharegpt_preference --tp 2 --pp 2 --max-steps 30 --seq-len 512
--global-batch-size 8 --lr 1e-3 --warmup-steps 3`. `hfmeg train --recipe dpo_llama ...` is the same
command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("dpo_llama")))
