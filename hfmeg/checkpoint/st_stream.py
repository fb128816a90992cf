"""Stream safetensors files: write one tensor at a time, read one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once, so a
converter writing one TP x PP rank file (1/(TP*PP) of the model) or one HF shard
(up to `--max-shard-size`) would hold that much. The format is simple enough to
stream: an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and `[begin, end)` byte offsets in the data section, then
the raw little-endian bytes. Every name, dtype and shape is known before any data
is read (they follow from the config and the split rules), so the header is
written first and each tensor's bytes follow in header order; only the tensor
being written is in memory. The files load with `safetensors.safe_open`.

Reading: `safe_open(...).get_tensor` returns a view on a private memory map of the
whole file, and every page a converter touches stays resident (and counts in its
RSS) for as long as the file is open, so streaming a checkpoint through it grows
RSS to the checkpoint's size. `read_tensor` instead reads the tensor's byte range
with one positioned read into fresh memory that is freed with the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import CheckpointError

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

Spec = tuple[torch.dtype, tuple[int, ...]]


class StreamingSafetensorsWriter:
    """`write(name, tensor)` in the order of `specs`, then `close()` (or use as a context manager)."""

    def __init__(self, path: str | Path, specs: dict[str, Spec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs = dict(specs)
        self._order = list(self._specs)
        self._next = 0
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, (dtype, shape) in self._specs.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
        self._file = None
        try:
            self._file = open(self.path, "wb")
            self._write_bytes(struct.pack("<Q", len(raw)) + raw)
        except OSError as e:
            self._abort()
            raise CheckpointError(f"{self.path}: cannot write ({e.strerror or e})") from e

    def _write_bytes(self, data) -> None:
        self._file.write(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            want = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise ValueError(f"{self.path}: expected {want} next, got {name}")
        dtype, shape = self._specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{self.path}: {name} is {tensor.dtype} {list(tensor.shape)}, header says {dtype} {list(shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        try:
            self._write_bytes(data.numpy().data)
        except OSError as e:
            self._abort()
            raise CheckpointError(f"{self.path}: write failed ({e.strerror or e})") from e
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            self._abort()
            raise ValueError(f"{self.path}: closed after {self._next} of {len(self._order)} tensors")
        try:
            self._file.close()
        except OSError as e:
            raise CheckpointError(f"{self.path}: write failed ({e.strerror or e})") from e

    def _abort(self) -> None:
        # Closing flushes what is still buffered, which on a full disk fails again; that second
        # error would replace the first (the one that names the file) with a raw traceback.
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()


class WriteBehind:
    """Run `writer.write` calls on one background thread, at most `depth` queued.

    Reading and slicing the next tensor then overlaps writing this one (file writes
    and torch copies release the GIL); memory grows by at most `depth` queued
    tensors. Call `drain()` before closing the writers; a write error surfaces at
    the next `write` or at `drain`.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfmeg-write")
        self._pending: deque[Future] = deque()

    def write(self, writer: StreamingSafetensorsWriter, name: str, tensor: torch.Tensor) -> None:
        self._pending.append(self._pool.submit(writer.write, name, tensor))
        while len(self._pending) > self.depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.drain()
        self._pool.shutdown(wait=True, cancel_futures=True)


def read_tensor(path: str | Path, name: str) -> torch.Tensor:
    """Tensor `name` of a safetensors file, read into its own memory (see the module docstring)."""
    path = Path(path)
    with open(path, "rb", buffering=0) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        info = header[name]
        begin, end = info["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            got = os.preadv(f.fileno(), [view[done:]], 8 + n + begin + done)
            if got == 0:
                raise CheckpointError(f"{path}: tensor {name} is truncated")
            done += got
    return buf.view(CODE_DTYPES[info["dtype"]]).reshape(info["shape"])
