"""hfmeg: Megatron-style parallel fine-tuning for Hugging Face LLaMA-family and GPT models."""

__version__ = "0.1.0"

import os as _os

# OpenMP waits passively rather than spinning: read once, when OpenMP starts (the first `import torch` after this);
# parallel/threads.py says why and sets the threads themselves.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
