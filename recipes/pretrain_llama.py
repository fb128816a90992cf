"""Continued pre-training of a LLaMA-family model on plain-text streams.

    accelerate launch --num_processes 8 recipes/pretrain_llama.py \
        --model meta-llama/Llama-2-7b-hf --data allenai/c4 --set data.sources.0.config=en

Every token is trained on (`data.format: text`); long documents are split into
`seq_len` pieces and packed. Defaults are in `recipes/configs/pretrain_llama.yaml`.
"""

import sys
from pathlib import Path

from hfmeg.train.cli import main

if __name__ == "__main__":
    sys.exit(main(__doc__, Path(__file__).parent / "configs" / "pretrain_llama.yaml"))
