"""Peers that stop: every rank beats in the job's store, and a rank whose peers fall silent stops itself.

A rank blocked in a collective cannot tell a slow peer from a lost one: gloo waits out its timeout (the
run's `train.collective_timeout_s`) when a peer's host or link is gone, or a peer is stopped (SIGSTOP), and
where a peer's process died it fails at once with "Connection closed by peer", naming an address, not a
rank. So a thread on each rank adds 1 to its counter in the job's TCPStore every `interval` (an eighth of
the timeout) and reads every other rank's counter in one `multi_get`. A rank whose counter has not moved
for `timeout - interval` is lost (and with it the ranks that missed two beats or more: the
same host's, whose beats fall a little later); so is the store itself when it does not answer within the timeout (its
host or link is gone). The survivor then prints one line naming the lost ranks and their host, and exits
with `EXIT_PEER_LOST` (`os._exit`: its main thread may be inside a collective that would never return), so
that torchrun's agent restarts the round (`--max-restarts`) and the run resumes from its newest complete
checkpoint. A peer is declared lost at most `timeout` after its last beat, so a survivor exits within
`timeout` of the loss (plus its own exit).

The store itself may be what is frozen: outside torchrun's shared store (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`,
which a multi-host job needs so that a restarted host can rejoin, and every launcher but torchrun's default)
the store lives in this round's rank 0, and a rank 0 stopped by SIGSTOP (or stuck in a driver call, a dead
mount, a swap storm) stops the store with it. A store client's request then blocks without end (the
server's kernel still takes the bytes), and the beating thread with it. So a second thread, the watch, holds
no connection and only reads the clock: when the beating thread has had no answer from the store for the
timeout (less one beat), the watch ends the process with the line, naming rank 0, its host and the last step
it reported when the store lives in rank 0 (its host's agent otherwise). Every survivor does so within the
timeout and a beat of the freeze; torchrun's agents then stop the round (the frozen rank by SIGKILL after
their grace period) and restart it. A thread of the rank itself would not do: a frozen process's threads
are all frozen, and the point is to watch rank 0 from the other ranks.

A frozen process cannot act on its launcher's SIGTERM, so torchrun's agent would wait out its grace period
(30 s) before its SIGKILL, and only then start the next round. So a survivor that names a lost rank on its
own host (by the host label every rank published, with its pid) kills it itself with SIGKILL before it exits;
the agent then finds every worker gone at its next look.

Each beat carries the rank's last finished step (`Heartbeat.step`, set by the trainer), so a line names
where the lost rank stood. When the store goes away (its rank exited, say after finding a frozen peer
itself) while some peer is already quiet, the line names that peer rather than the store.

A rank that finishes (or fails by itself) marks itself gone first, so that its silence is not a loss.
The keys live under a prefix drawn by rank 0 for this world (broadcast at start), so a restarted round
never reads a dead round's counters. The thread holds its own store connection: a client serves one
request at a time.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

EXIT_PEER_LOST = 3
BEATS_PER_TIMEOUT = 8
SIGNAL_POLL_S = 0.1  # how often a rank waiting for the verdict looks for a signal that ends the wait


def host_label() -> str:
    """This rank's host as its peers should read it: torchrun's node rank, the host name and the address it
    reaches the store from (namespace hosts share one host name)."""
    node = os.environ.get("GROUP_RANK")
    addr = "?"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: a route is chosen
            s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            addr = s.getsockname()[0]
    except (OSError, KeyError, ValueError):
        pass
    name = f"{socket.gethostname()} {addr}"
    return f"host {node} ({name})" if node is not None else f"host {name}"


class Heartbeat:
    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float, hosts: list[str],
                 pids: list[int]):
        self.store, self.rank, self.world, self.timeout_s, self.hosts = store, rank, world, timeout_s, hosts
        self.pids = pids
        self.interval = timeout_s / BEATS_PER_TIMEOUT
        self.step = 0  # this rank's last finished step, which its beats report
        self.steps = [0] * world  # every rank's, as last read
        self.answered = time.monotonic()  # when the store last answered the beating thread
        self._quiet: list[int] = []  # the ranks that missed two beats or more, as last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hfmeg-heartbeat")
        self._watch = threading.Thread(target=self._watch_store, daemon=True, name="hfmeg-heartbeat-watch")

    @classmethod
    def start(cls, timeout_s: float, device: torch.device) -> "Heartbeat | None":
        """Collective: start this rank's heartbeat (None for a world of one, or `timeout_s` 0: off)."""
        world = dist.get_world_size()
        if timeout_s <= 0 or world == 1 or "MASTER_ADDR" not in os.environ:
            return None
        rank = dist.get_rank()
        token = torch.randint(1 << 62, (1,), device=device) if rank == 0 else torch.zeros(1, dtype=torch.int64,
                                                                                             device=device)
        dist.broadcast(token, 0)
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=timeout_s))
        store = dist.PrefixStore(f"hfmeg/heartbeat/{int(token.item()):x}/", client)
        store.set(f"host/{rank}", host_label())
        store.set(f"pid/{rank}", str(os.getpid()))
        store.set(f"beat/{rank}", "0 0")
        store.set(f"gone/{rank}", "0")
        dist.barrier()  # every rank's keys exist: one multi_get reads them all
        hosts = [b.decode() for b in store.multi_get([f"host/{r}" for r in range(world)])]
        pids = [int(b) for b in store.multi_get([f"pid/{r}" for r in range(world)])]
        beat = cls(store, rank, world, timeout_s, hosts, pids)
        beat._thread.start()
        beat._watch.start()
        return beat

    def _run(self) -> None:
        keys = [f"beat/{r}" for r in range(self.world)] + [f"gone/{r}" for r in range(self.world)]
        last: list[bytes | None] = [None] * self.world
        moved = [time.monotonic()] * self.world
        beats = 0
        while not self._stop.wait(self.interval):
            beats += 1
            try:
                self.store.set(f"beat/{self.rank}", f"{beats} {self.step}")
                values = self.store.multi_get(keys)
            except (RuntimeError, ValueError) as e:  # the store's host or link is gone (or it timed out)
                if self._stop.is_set():
                    return
                why = str(e).splitlines()[0][:120]
                if self._quiet:  # the store went away after a peer fell silent: that peer is the news
                    self._lost(f"{self._ranks(self._quiet, time.monotonic() - min(moved[r] for r in self._quiet))}"
                               f" (then the job's store went away: {why})", self._quiet)
                self._lost(f"{self._store_holder()} ({why})", self._holder())
                return
            now = self.answered = time.monotonic()
            self._quiet = []  # ranks (not gone) that missed two beats or more: named beside a lost one (same host's)
            for r in range(self.world):
                if values[r] != last[r]:
                    last[r], moved[r] = values[r], now
                    self.steps[r] = int(values[r].split()[1])
                elif r != self.rank and values[self.world + r] == b"0" and now - moved[r] > 2 * self.interval:
                    self._quiet.append(r)
            if any(now - moved[r] > self.timeout_s - self.interval for r in self._quiet):
                self._lost(self._ranks(self._quiet, now - min(moved[r] for r in self._quiet)), self._quiet)

    def _ranks(self, ranks: list[int], silent_s: float) -> str:
        where = sorted({self.hosts[r] for r in ranks})
        steps = ", ".join(str(self.steps[r]) for r in ranks)
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {', '.join(where)}: no "
                f"heartbeat for {silent_s:.1f} s (last step {steps})")

    def _holder(self) -> list[int]:
        """The rank whose process holds the store: [0] outside torchrun's shared store, else none."""
        return [] if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else [0]

    def _store_holder(self) -> str:
        """What a store that does not answer means: rank 0 itself where the store lives in it."""
        where = f"the job's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent on the first host holds it
            return f"{where}, held by the first host's torchrun agent, does not answer"
        return (f"rank 0 on {self.hosts[0]} (last step {self.steps[0]}): {where}, which rank 0 holds, does not "
                "answer")

    def _watch_store(self) -> None:
        """The watch (see the module docstring): no store request of its own, so a frozen store cannot hold it."""
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self.answered
            if silent > self.timeout_s:
                self._lost(f"{self._store_holder()} for {silent:.1f} s", self._holder())

    def _lost(self, what: str, ranks: list[int]) -> None:
        """Say what is lost, kill the lost `ranks` that run on this host (see the module docstring), and exit."""
        if self._stop.is_set():
            return
        print(f"hfmeg: lost {what} (train.heartbeat_timeout_s {self.timeout_s:g}); rank {self.rank} on "
              f"{self.hosts[self.rank]} stops (exit {EXIT_PEER_LOST})", file=sys.stderr, flush=True)
        for r in ranks:
            if r != self.rank and self.hosts[r] == self.hosts[self.rank]:
                try:
                    os.kill(self.pids[r], signal.SIGKILL)
                except OSError:  # gone already, or not ours to signal
                    pass
        os._exit(EXIT_PEER_LOST)

    def wait_verdict(self, error: BaseException, until: Callable[[], bool] = lambda: False) -> bool:
        """After a collective failed: wait (at most a timeout and a beat) for the thread to name a lost peer,
        which ends the process; returns False if none is found (the error is another one), True at once when
        `until()` holds (a signal came: the launcher is stopping this worker, no verdict is needed)."""
        if not (isinstance(error, dist.DistError) or "gloo" in str(error)):
            return False
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval
        while self._thread.is_alive() and time.monotonic() < deadline:
            if until():
                return True
            self._thread.join(min(self.interval, SIGNAL_POLL_S))
        return until()

    def signalled(self, signal_name: str | None, error: BaseException, code: int) -> None:
        """End the process at once, with one line, after a collective failed and a signal came (a launcher
        stops the other workers once one died): `os._exit`, since tearing the process group down would wait
        on the peer that is gone, and the launcher would SIGKILL this worker after its grace period."""
        self._stop.set()
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        print(f"hfmeg: rank {self.rank} on {self.hosts[self.rank]} stops on {signal_name} after a collective with "
              f"its peers failed ({first}) (exit {code})", file=sys.stderr, flush=True)
        os._exit(code)

    def stop(self) -> None:
        """This rank leaves: its silence from now on is not a loss."""
        try:
            self.store.set(f"gone/{self.rank}", "1")
        except RuntimeError:  # the store is gone too: nobody is left to read it
            pass
        self._stop.set()
        self._thread.join()
        self._watch.join()
