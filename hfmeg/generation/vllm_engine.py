"""vLLM as a generation engine (engine.py's interface), in a process of its own started and stopped by hfmeg.

vLLM pins its own torch and transformers, so it lives in its own virtualenv (`make .venv-vllm`, or any python with
vLLM named by HFMEG_VLLM_PYTHON) and runs `vllm_worker.py` there; the two processes exchange JSON messages on a
socket pair. The engine holds one model for its life: `load(folder)` swaps the weights in place from a safetensors
folder (vLLM's `reload_weights`, well under a second for a small model, against a 35-100 s engine start) and empties
the prefix cache, whose blocks the old weights computed.

Sampling: one vLLM request per completion, each with its own seed (vLLM draws a seeded request from its own
generator, so its completion does not depend on the rest of the batch); greedy at temperature 0. The log-probability
vLLM reports of each chosen token is its processed one (`logprobs_mode="processed_logprobs"`, as TRL asks for):
log_softmax(logits / temperature), what the interface and the training forward have, as long as top-k and top-p
are off (GRPO's defaults); with either on, vLLM renormalises over the tokens they keep, and the mismatch metric
shows that difference (as it does for TRL with vLLM). On CPU the engine runs eager fp32
(VLLM_CPU_KVCACHE_SPACE GiB of KV cache, 1 by default); vLLM's CPU attention needs a head_dim of at least 32.

No worker outlives its engine: `close()` (also at interpreter exit, and from `Rollouts.close` when a run stops,
by Ctrl-C or an error) asks it to stop and kills it after a grace period; a SIGKILLed parent's worker gets SIGKILL
from the kernel (vllm_worker.py).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import time
from multiprocessing.connection import Connection
from pathlib import Path

from ..data.rollouts import Completion
from ..errors import EngineError
from .engine import SamplingParams

WORKER = Path(__file__).with_name("vllm_worker.py")
VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # the make target's, beside the source tree
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 10.0


def cpu_kv_cache_gib() -> int:
    """The KV cache a worker on a CPU host is given, in GiB: `VLLM_CPU_KVCACHE_SPACE`, 1 unless set (vLLM's CPU backend
    then reserves that and nothing more beside the weights; the planner counts it, plan/rollout.py)."""
    return int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1)


def vllm_python() -> Path:
    """The vLLM environment's interpreter; EngineError saying how to make it when there is none."""
    named = os.environ.get("HFMEG_VLLM_PYTHON")
    python = Path(named) if named else VENV / "bin" / "python"
    if not python.is_file():
        where = f"HFMEG_VLLM_PYTHON={named}" if named else str(VENV)
        raise EngineError(f"grpo.generator vllm: no vLLM environment at {where}; make it with `make .venv-vllm` "
                          f"(from the hfmeg source tree), or use --generator transformers")
    return python


class VLLMEngine:
    """A vLLM worker process serving the HF folder `folder` (fp32, eager); `eos_ids` end a completion.
    `log`: where the worker's output goes (appended). `pad_id` is unused (vLLM pads nothing) but kept so the
    engines are built alike. `gpu_memory_utilization`: on a GPU, the share of its memory vLLM reserves for all it
    holds (None: vLLM's default, 0.9); a CPU host's worker has its KV cache given instead (`cpu_kv_cache_gib`)."""

    def __init__(self, folder: Path, eos_ids: list[int], pad_id: int | None = None, *, log: Path | None = None,
                 max_model_len: int | None = None, gpu_memory_utilization: float | None = None):
        self.eos_ids, self.owner = list(eos_ids), os.getpid()
        self.proc: subprocess.Popen | None = None
        python = vllm_python()
        mine, theirs = socket.socketpair()
        settings = dict(dtype="float32", enforce_eager=True, seed=0, logprobs_mode="processed_logprobs",
                        parent=os.getpid(), **({"max_model_len": max_model_len} if max_model_len else {}),
                        **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization else {}))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_cache_gib()),
               "TOKENIZERS_PARALLELISM": "false"}
        self.log = log
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            # its own session: a Ctrl-C at the terminal reaches hfmeg, whose close() stops the worker
            self.proc = subprocess.Popen([str(python), str(WORKER), str(theirs.fileno()), str(folder),
                                          json.dumps(settings)], pass_fds=[theirs.fileno()], env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
            if log:
                out.close()
        atexit.register(self.close)
        self.conn = Connection(mine.detach())
        try:
            answer = self._wait(START_TIMEOUT_S, "starting")
        except BaseException:  # Ctrl-C or an error while vLLM starts: the worker goes too
            self.close()
            raise
        if "error" in answer:
            self.close()
            logged = f" (vLLM's log: {log})" if log else ""
            if answer.get("stage") == "import":
                raise EngineError(f"grpo.generator vllm: vLLM does not import in {python}: {answer['error']}; remake "
                                  f"its environment (rm -r .venv-vllm; make .venv-vllm){logged}")
            raise EngineError(f"grpo.generator vllm: vLLM cannot serve {folder}: {answer['error']}; use "
                              f"--generator transformers{logged}")

    def _wait(self, timeout: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            alive = self._alive()
            if not alive or time.monotonic() > deadline:
                code = self.proc.poll() if os.getpid() == self.owner else None
                self.close()
                why = f"did not answer in {timeout:.0f} s" if alive else "exited" + (
                    f" with code {code}" if code is not None else "")
                raise EngineError(f"grpo.generator vllm: the vLLM worker {why} while {doing}"
                                  + (f"; its log: {self.log}" if self.log else ""))
        try:
            return json.loads(self.conn.recv_bytes())
        except EOFError:
            self.close()
            raise EngineError(f"grpo.generator vllm: the vLLM worker closed while {doing}") from None

    def _alive(self) -> bool:
        if os.getpid() == self.owner:
            return self.proc.poll() is None
        try:  # a forked child's copy (a trainer rank given the engine): the worker is not its child to wait for
            os.kill(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _ask(self, request: dict, doing: str) -> dict:
        if self.proc is None:
            raise EngineError("grpo.generator vllm: the engine was closed")
        self.conn.send_bytes(json.dumps(request).encode())
        answer = self._wait(START_TIMEOUT_S, doing)
        if "error" in answer:
            raise EngineError(f"grpo.generator vllm: {doing} failed: {answer['error']}")
        return answer

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        answer = self._ask(dict(op="generate", prompts=prompts, seeds=seeds, eos_ids=self.eos_ids,
                                max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                top_p=params.top_p, top_k=params.top_k), "generating")
        return [Completion(list(p), c["ids"], c["logps"], truncated=c["truncated"])
                for p, c in zip(prompts, answer["completions"])]

    def load(self, folder: Path) -> None:
        self._ask(dict(op="load", folder=str(folder)), f"loading the weights of {folder}")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def close(self) -> None:
        """Stops the worker (asks, then kills after STOP_GRACE_S); idempotent."""
        if self.proc is None or os.getpid() != self.owner:  # a forked child's copy: the worker is its parent's
            return
        proc, self.proc = self.proc, None
        atexit.unregister(self.close)
        try:
            if proc.poll() is None:
                try:
                    self.conn.send_bytes(json.dumps({"op": "stop"}).encode())
                except OSError:
                    pass
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            self.conn.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
