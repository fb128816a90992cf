"""Convert Megatron-style TP x PP shards back into an HF folder, a LoRA checkpoint into a PEFT adapter folder
(`--merge DIR`: also the merged model): `hfmeg convert to-hf`.

    python tools/convert_mp_to_hf.py --mp ckpt/llama7b-tp4pp2 --out export/llama7b --max-shard-size 5GB
    python tools/convert_mp_to_hf.py --mp out/lora/checkpoints --out export/adapter --merge export/merged

The command is hfmeg/commands/convert.py; `--help` describes it.
"""

import sys

from hfmeg.commands.convert import to_hf as main

if __name__ == "__main__":
    sys.exit(main())
