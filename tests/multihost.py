"""A cluster of hosts on one machine: Linux network namespaces joined by a switch, with shaped links.

    with Hosts(2) as hosts:                       # namespaces made here, torn down on leaving
        jobs = [hosts.torchrun(h, 2, train_args(...), log_dir / f"host{h}.log") for h in range(hosts.n)]
        codes = wait_all(jobs, timeout_s=120)

Each host is a namespace `hfmeg-<pid>-<k>-h<i>` holding one interface, `eth0`, with the address
`10.0.0.<i+1>/24`, and its loopback; its processes also get a UTS namespace of their own with the host
name `h<i>`, and an /etc/hosts (`ip netns exec` mounts `/etc/netns/<name>/hosts` over it) that resolves
every host's name to its address, as on a real cluster. The switch is one more namespace (`...-sw`)
holding a bridge and the other ends of the hosts' veth pairs, so the machine's own namespace gets no
interface and no address, and deleting the switch removes every link at once. Two beds never collide: each has its own switch (the same
addresses in different beds are different networks) and its own names.

The links between hosts are shaped on both ends of each veth pair: `tbf` at `RATE` on each direction, and
`netem` adds `DELAY_MS` each way where the kernel has it (`shaping` says what was applied). Ranks on one
host reach each other through their host's own address, which Linux delivers over the loopback: only
traffic between hosts crosses the shaped links.

torchrun runs in each host with the c10d rendezvous on `h0`, so torchrun's own ways of finding the store's
host (its host name) and gloo's of finding its interface (the address the host name resolves to) are the
ones a cluster exercises. A bed whose creator died (a killed test run) is removed by the next one
(`clean_stale`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from itertools import count
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
PREFIX = "hfmeg-"
ETC_NETNS = Path("/etc/netns")  # where `ip netns exec` finds a namespace's own /etc files
RATE = "1gbit"  # a commodity inter-host link; the cluster has 100 Gbit/s between 8-GPU nodes
DELAY_MS = 0.5
MONITOR_S = 0.5  # how often torchrun's agent looks at its workers
# How soon the rendezvous drops a lost host's agent (docs/multihost.md#restarts), as the launch files set it.
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=5"
RDZV_PORT = 29400  # every bed has its own network, so a fixed port cannot clash with another bed's
STAND_IN_ENV = "HFMEG_STAND_IN_HOSTS"
_beds = count()


def in_host(ns: str, hostname: str, cmd: list[str]) -> list[str]:
    """`cmd` run in namespace `ns` under its own host name (a UTS namespace of its own)."""
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *cmd]


class NamespaceUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, a sandbox without them)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _namespaces() -> list[str]:
    try:
        out = _ip("netns", "list", check=False).stdout
    except FileNotFoundError:  # no `ip`: no namespaces either
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (a namespace outlives its deletion while processes hold it)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def clean_stale() -> list[str]:
    """Remove the beds of test runs that died without tearing theirs down; the names removed."""
    gone = []
    for ns in _namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    for etc in ETC_NETNS.glob(f"{PREFIX}*") if ETC_NETNS.is_dir() else ():
        m = re.match(rf"{PREFIX}(\d+)-", etc.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(etc, ignore_errors=True)
    return gone


class Hosts:
    def __init__(self, n: int, *, rate: str = RATE, delay_ms: float = DELAY_MS):
        self.n = n
        self.name = f"{PREFIX}{os.getpid()}-{next(_beds)}"
        self.switch = f"{self.name}-sw"
        self.hosts = [f"{self.name}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self.shaping = f"tbf {rate}"
        if os.geteuid() != 0:
            raise NamespaceUnavailable("network namespaces need root")
        try:
            clean_stale()
            self._build(rate, delay_ms)
        except (subprocess.CalledProcessError, FileNotFoundError, OSError) as e:
            self.close()
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise NamespaceUnavailable(f"cannot build the namespace hosts: {detail}") from None

    def _build(self, rate: str, delay_ms: float) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        netem = True
        for i, ns in enumerate(self.hosts):
            _ip("netns", "add", ns)
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{self.addr(j)} {self.hostname(j)}\n"
                                                                         for j in range(self.n)))
            _ip("-n", ns, "link", "set", "lo", "up")
            port = f"p{i}"
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            for where, dev in ((ns, "eth0"), (sw, port)):
                delayed = self._tc(where, dev, rate, delay_ms)  # on every link, whatever the others got
                netem = netem and delayed
        if netem:
            self.shaping += f" + netem {delay_ms} ms each way"

    @staticmethod
    def _tc(ns: str, dev: str, rate: str, delay_ms: float) -> bool:
        """Shape `dev`'s egress: netem delay with tbf under it, or tbf alone where netem is absent."""
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
        if delay_ms and subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms"],
                                       capture_output=True).returncode == 0:
            subprocess.run([*tc, "parent", "1:1", "handle", "10:", *tbf], check=True, capture_output=True, text=True)
            return True
        subprocess.run([*tc, "root", *tbf], check=True, capture_output=True, text=True)
        return False

    @staticmethod
    def addr(i: int) -> str:
        return f"10.0.0.{i + 1}"

    @staticmethod
    def hostname(i: int) -> str:
        return f"h{i}"

    def env(self, i: int) -> dict[str, str]:
        """The environment of host `i`'s processes: this checkout's hfmeg, on the CPU with gloo."""
        return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "HFMEG_BACKEND": "gloo"}

    def popen(self, i: int, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `cmd` in host `i` (its own session, output to `log`); stopped by `close`."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(in_host(self.hosts[i], self.hostname(i), cmd), stdout=out,
                                    stderr=subprocess.STDOUT, env=env or self.env(i), start_new_session=True,
                                    cwd=ROOT)
        self.procs.append(proc)
        return proc

    def torchrun_args(self, nproc: int, *, max_restarts: int = 0, run_id: str = "hfmeg") -> list[str]:
        """torchrun's flags on every host of this bed: c10d rendezvous on host 0 (`h0`), which hosts the store."""
        return [str(TORCHRUN), "--nnodes", str(self.n), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.hostname(0)}:{RDZV_PORT}", "--rdzv-id", run_id,
                "--max-restarts", str(max_restarts), "--monitor-interval", str(MONITOR_S), "--rdzv-conf", RDZV_CONF]

    def torchrun(self, i: int, nproc: int, args: list[str], log: Path, env: dict[str, str] | None = None,
                 **kw) -> subprocess.Popen:
        """torchrun `args` in host `i` with `nproc` ranks (`env`: added to the host's environment)."""
        return self.popen(i, [*self.torchrun_args(nproc, **kw), *args], log, {**self.env(i), **(env or {})})

    def stand_in_env(self) -> dict[str, str]:
        """What tests/slurm_stand_ins/ read: this bed's hosts as `namespace=hostname` pairs."""
        return {STAND_IN_ENV: " ".join(f"{ns}={self.hostname(i)}" for i, ns in enumerate(self.hosts))}

    def pids(self, i: int) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.hosts[i], check=False).stdout.split()]

    def link_down(self, i: int) -> None:
        _ip("-n", self.hosts[i], "link", "set", "eth0", "down")

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in [*self.hosts, self.switch]:
            if ns in _namespaces():
                _kill_inside(ns)
                _ip("netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        for proc in self.procs:
            proc.wait()

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Each process's exit code once all have exited, or None for one still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]


def train_args(model: Path, data: Path, out: Path, *flags: str, steps: int = 4) -> list[str]:
    """torchrun's arguments for `-m hfmeg train` on the SFT recipe: a short fp32 run (`flags` add to it)."""
    return ["-m", "hfmeg", "train", "--recipe", "sft_llama13b", *recipe_flags(model, data, out, *flags, steps=steps)]


def recipe_flags(model: Path, data: Path, out: Path, *flags: str, steps: int = 4) -> list[str]:
    """The SFT recipe's flags for a short fp32 run of `steps` steps on `model` and `data` into `out`."""
    return ["--model", str(model), "--data", str(data), "--seq-len", "64", "--global-batch-size", "4",
            "--max-steps", str(steps), "--lr", "3e-3", "--warmup-steps", "1", "--dtype", "fp32", "--eval-every", "0",
            "--out", str(out), "--report-to", "none", *flags]


def run_job(hosts: Hosts, nproc: int, args: list[str], logs: Path, *, timeout_s: float = 120, **kw) -> None:
    """torchrun `args` on every host of `hosts` (`nproc` ranks each); raise with the logs unless all exit 0."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = [hosts.torchrun(i, nproc, args, logs / f"host{i}.log", **kw) for i in range(hosts.n)]
    codes = wait_all(procs, timeout_s)
    if codes != [0] * hosts.n:
        tails = "\n".join(f"--- host {i}:\n" + (logs / f"host{i}.log").read_text()[-3000:] for i in range(hosts.n))
        raise AssertionError(f"exit codes {codes} (None: still running after {timeout_s:.0f} s)\n{tails}")


def worker_ranks(hosts: Hosts, i: int, agent: subprocess.Popen) -> dict[int, int]:
    """{pid: RANK} of the workers torchrun (`agent`) runs in host `i` now."""
    out = {}
    for pid in hosts.pids(i):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if pid != agent.pid and rank:
            out[pid] = int(rank[0])
    return out


def wait_for(predicate, timeout_s: float, what: str, procs: list[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a launcher exited (codes {[p.poll() for p in procs]}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s:.0f} s")
        time.sleep(0.05)
