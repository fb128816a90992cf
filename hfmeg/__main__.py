"""`python -m hfmeg COMMAND ...`, as the `hfmeg` console script (also `torchrun ... -m hfmeg train ...`)."""

import sys

from .commands.main import main

sys.exit(main())
