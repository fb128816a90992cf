"""Supervised fine-tuning of DeepSeek-V3 (671B) with expert parallelism on 32 nodes of 8 x 80 GB GPUs.

    accelerate launch --config_file recipes/accelerate/multi_node.yaml --num_machines 32 --num_processes 256 \
        --machine_rank $NODE_RANK --main_process_ip $MASTER_IP recipes/sft_deepseek_v3.py \
        --model deepseek-ai/DeepSeek-V3 --data tatsu-lab/alpaca

Defaults (TP=1 x PP=32 x DP=8 with EP=8, seq 4096, bf16, full recompute: the planner's layout) and their
memory arithmetic are in `hfmeg/train/recipes/sft_deepseek_v3.yaml`; the checkpoint's fp8 weights must be
converted to bf16 first. Smaller models of the architecture (model_type deepseek_v3) run with the same script
and their own `--pp`/`--ep` (`hfmeg plan --model ... --gpus N` finds them).
`hfmeg train --recipe sft_deepseek_v3 ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("sft_deepseek_v3")))
