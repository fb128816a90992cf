"""Online RL (GRPO and its variants: DAPO, Dr. GRPO, BNPO, GSPO) of an SFT'd LLaMA on one node of 8 x 80 GB GPUs.

    torchrun --nproc-per-node 8 recipes/grpo_llama.py \
        --model my-org/llama3-8b-sft --data my-org/math-prompts --reward-funcs accuracy
    torchrun --nproc-per-node 8 -m hfmeg train --recipe grpo_llama --model ... --data ... \
        --reward-funcs accuracy,my_rewards:format_reward --loss-type grpo --beta 0.04 --num-generations 8

The data has a `prompt` column (a string, or a conversation rendered with the chat template); its other
columns (`solution`, `answer`, ...) go to the reward functions. Defaults (TRL's DAPO loss, TP=2 x DP=4
with sequence parallelism, bf16, 8 completions per prompt, the in-process transformers engine on rank 0)
are in `hfmeg/train/recipes/grpo_llama.yaml`; docs/grpo.md says what is built. On CPU, e.g. `--model
../shared/assets/models/stories260K --data prompts.jsonl --reward-funcs grpo_toy_rewards:park --tp 2 --pp 2
--max-steps 30 --seq-len 64 --max-completion-length 16 --num-generations 4 --global-batch-size 16 --lr 1e-3`
(`recipes/grpo_toy_rewards.py`).
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("grpo_llama")))
