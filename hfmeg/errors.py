"""Typed errors: every user-facing failure is one of these, with one clear line."""


class HfmegError(Exception):
    """Base class; CLIs print `str(e)` and exit with code 2.

    `agreed`: every rank of the job raised this same error together (`parallel.agree`), so
    rank 0 alone reports it."""

    agreed = False


class UnsupportedConfigError(HfmegError):
    """A model or parallel configuration hfmeg cannot run (names the field)."""


class CheckpointError(HfmegError):
    """A checkpoint folder or file that is missing, corrupt or inconsistent (names the file)."""


class LayoutError(HfmegError):
    """A parallel layout (TP/PP/DP/VPP, micro-batches) that does not fit the world or the model."""


class DataError(HfmegError):
    """Training data that cannot be read or used (names the file and record or the config field)."""


class RunLockedError(HfmegError):
    """`--out` belongs to another live run (or cannot be locked); names the holder."""


class EngineError(HfmegError):
    """A generation engine that cannot start or cannot serve the model (names the engine, the reason, the way out)."""
