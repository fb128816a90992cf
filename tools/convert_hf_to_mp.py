"""Convert an HF checkpoint (folder or Hub id) into Megatron-style TP x PP shards: `hfmeg convert to-mp`.

    python tools/convert_hf_to_mp.py --hf meta-llama/Llama-2-7b-hf --out ckpt/llama7b-tp4pp2 --tp 4 --pp 2

The command is hfmeg/commands/convert.py; `--help` describes it.
"""

import sys

from hfmeg.commands.convert import to_mp as main

if __name__ == "__main__":
    sys.exit(main())
