"""Supervised fine-tuning of Mixtral-8x7B with expert parallelism on two nodes of 8 x 80 GB GPUs.

    accelerate launch --config_file recipes/accelerate/multi_node.yaml --machine_rank $NODE_RANK \
        --main_process_ip $MASTER_IP recipes/sft_mixtral.py \
        --model mistralai/Mixtral-8x7B-v0.1 --data tatsu-lab/alpaca

Defaults (TP=1 x PP=2 x DP=8 with EP=8, seq 4096, bf16, full recompute) and their memory
arithmetic, including why one node of 8 x 80 GB cannot hold a full fine-tune, are in
`hfmeg/train/recipes/sft_mixtral.yaml`. Any flag overrides them (`--ep`, `--pp`, ...); metrics.jsonl
logs the min/max tokens per expert of every MoE layer at each step. Qwen2-MoE and Qwen3-MoE
run with the same script and their own `--ep` (a divisor of both the DP size and the expert count).
`hfmeg train --recipe sft_mixtral ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_mixtral")))
