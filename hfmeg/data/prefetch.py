"""Build the next batches in a background thread while the current step runs.

    ahead = Prefetcher(produce, depth=2)   # produce() is called only in the thread, in order
    value = ahead.get()                    # the next result; the producer's exception, re-raised
    ahead.close()                          # stop and join (also done at interpreter exit)

A thread, not a process: the expensive part, the fast tokenizer's `encode_batch`,
runs in Rust without the GIL, and the pipeline's state stays in this process, so
a batch's resumable state can travel with it (see `loader.TrainData`). The queue
is bounded, so the producer is at most `depth` results ahead and then waits. The
thread is a daemon and holds no reference to its `Prefetcher`, so a forgotten one
is stopped when it is garbage-collected or when the interpreter exits.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_POLL_S = 0.1  # how often a producer blocked on a full queue checks for close()


def _run(produce: Callable[[], Any], out: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            item: tuple[Any, BaseException | None] = (produce(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            item = (None, e)
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if item[1] is not None:
            return


def _shutdown(stop: threading.Event, out: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    while thread.is_alive():  # empty the queue so a producer blocked in put() sees `stop`
        try:
            out.get_nowait()
        except queue.Empty:
            pass
        thread.join(_POLL_S)


class Prefetcher:
    def __init__(self, produce: Callable[[], Any], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        thread = threading.Thread(target=_run, args=(produce, self._queue, stop), name="hfmeg-data-prefetch",
                                  daemon=True)
        thread.start()
        self._error: BaseException | None = None
        self._close = weakref.finalize(self, _shutdown, stop, self._queue, thread)

    def get(self) -> Any:
        if self._error is None:
            value, self._error = self._queue.get()
            if self._error is None:
                return value
        raise self._error  # the producer has stopped; every later call raises the same error

    def close(self) -> None:
        self._close()
