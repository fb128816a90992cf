"""Reshard an MP checkpoint (a training checkpoint whole) to another TP x PP (x VPP) layout: `hfmeg reshard`.

    python tools/reshard_mp.py --mp ckpt/llama7b-tp2pp2 --out ckpt/llama7b-tp4pp1 --tp 4 --pp 1

The command is hfmeg/commands/reshard.py; `--help` describes it.
"""

import sys

from hfmeg.commands.reshard import main

if __name__ == "__main__":
    sys.exit(main())
