"""Continued pre-training of a LLaMA-family model on plain-text streams.

    accelerate launch --num_processes 8 recipes/pretrain_llama.py \
        --model meta-llama/Llama-2-7b-hf --data allenai/c4 --set data.sources.0.config=en

Every token is trained on (`data.format: text`); long documents are split into
`seq_len` pieces and packed. Defaults are in `hfmeg/train/recipes/pretrain_llama.yaml`.
`hfmeg train --recipe pretrain_llama ...` is the same command.
"""

import sys

from hfmeg.train.cli import main, recipe_config

if __name__ == "__main__":
    sys.exit(main(__doc__, recipe_config("pretrain_llama")))
