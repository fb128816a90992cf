"""Check a converted MP checkpoint against transformers, logits and greedy generation: `hfmeg verify`.

    python tools/verify_parity.py --mp ckpt/llama7b-tp4pp2 --hf meta-llama/Llama-2-7b-hf
    torchrun --nproc-per-node 8 tools/verify_parity.py --mp ckpt/llama7b-tp4pp2 --hf ...

The command is hfmeg/commands/verify.py; `--help` describes it.
"""

import sys

from hfmeg.commands.verify import main

if __name__ == "__main__":
    sys.exit(main())
