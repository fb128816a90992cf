"""hfmeg: Megatron-style parallel fine-tuning for Hugging Face LLaMA-family and GPT models."""

__version__ = "0.1.0"

import os as _os

# OpenMP waits passively rather than spinning: read once, when OpenMP starts (the first `import torch` after this);
# parallel/threads.py says why and sets the threads themselves.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A launcher's worker (torchrun and accelerate set LOCAL_RANK) logs torch's C++ errors only, not its warnings: when a
# peer or the job's store goes away, c10d's TCPStore client logs a warning with a C++ stack dump in every rank
# (`recvValue failed ... Connection reset by peer`) before the Python error that the rank reports in its one line
# (parallel/heartbeat.py). Read once, when torch's C++ library loads; a setting of the user's own is kept.
if "LOCAL_RANK" in _os.environ:
    _os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
