"""The vLLM side of `vllm_engine.VLLMEngine`: a script run by the vLLM virtualenv's python (vLLM pins its own torch
and transformers, so it cannot share hfmeg's environment or process). It imports only the standard library and
vLLM, never hfmeg.

    python vllm_worker.py FD MODEL_FOLDER SETTINGS_JSON

FD is the child's end of a socket pair the engine made; requests and answers are JSON messages on it
(`multiprocessing.connection` framing, no pickle). The first answer is {"ready": true} or {"error": "...", "stage": ...}
(vLLM failed to import, or refused the model). Requests: {"op": "generate", ...} -> {"completions": [...]}, {"op": "load",
"folder": ...} -> {"ok": true}, {"op": "stop"}. A failed request answers {"error": "..."} and the worker goes on.

The worker dies with the engine's process: the kernel kills it when its parent exits (PR_SET_PDEATHSIG, also on
SIGKILL), and an end-of-file on the socket (the parent gone or closed it) ends the loop. vLLM's engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the engine), so no grandchild outlives it.
"""

import ctypes
import json
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above ran
        os._exit(1)


def reason(e: BaseException) -> str:
    """The innermost cause's message: vLLM wraps what it refused in engine-start errors."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def generate(llm, req: dict) -> list[dict]:
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(n=1, max_tokens=req["max_new_tokens"], temperature=req["temperature"],
                             top_p=req["top_p"], top_k=req["top_k"] or -1, seed=seed, logprobs=0,
                             stop_token_ids=req["eos_ids"], detokenize=False)
              for seed in req["seeds"]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
    answers = []
    for out in outs:
        c = out.outputs[0]
        ids = list(c.token_ids)
        answers.append({"ids": ids, "logps": [step[t].logprob for step, t in zip(c.logprobs, ids)],
                        "truncated": c.finish_reason == "length"})
    return answers


def main() -> int:
    fd, model, settings = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    die_with_parent(settings.pop("parent"))
    conn = Connection(fd)
    try:
        from vllm import LLM
    except Exception as e:  # a broken environment, not the model's fault
        traceback.print_exc()
        conn.send_bytes(json.dumps({"error": reason(e), "stage": "import"}).encode())
        return 1
    try:
        llm = LLM(model=model, skip_tokenizer_init=True, **settings)
        # one token through the model: some refusals (vLLM's CPU attention below head_dim 32) come at the first
        # forward, not at the engine's construction, and belong to the start's answer
        from vllm import SamplingParams, TokensPrompt

        llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1), use_tqdm=False)
    except Exception as e:  # what vLLM refused about the model, for the engine's one line
        traceback.print_exc()
        conn.send_bytes(json.dumps({"error": reason(e), "stage": "model"}).encode())
        return 1
    conn.send_bytes(json.dumps({"ready": True}).encode())
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except EOFError:
            return 0
        if req["op"] == "stop":
            return 0
        try:
            if req["op"] == "generate":
                answer = {"completions": generate(llm, req)}
            else:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": req["folder"]})
                llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
                answer = {"ok": True}
        except Exception as e:
            traceback.print_exc()
            answer = {"error": reason(e)}
        conn.send_bytes(json.dumps(answer).encode())


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's exit handlers have nothing to free in this process and can take seconds
