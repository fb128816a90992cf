"""The vLLM generation engine (hfmeg/generation/vllm_engine.py) against transformers and hfmeg's training forward.

One engine serves the whole module (a vLLM start costs 35-100 s on CPU): the model is stories260K with its heads
regrouped to head_dim 32 (vLLM's CPU attention needs >= 32; stories260K's is 8): two query heads of 32 over the same
q_proj rows, its four KV heads of 8 read as one of 32, repeated to two so TP2 splits them. Its embeddings, MLPs and
head are the trained ones, so its next-token distributions are peaked like a trained model's.

Bounds: vLLM and transformers both run the model's fp32 forward; each is within the suite's fp32 logit bound TOL of
the exact logits, so a log-probability (a log-softmax of them) on one side is within 2 TOL of the other's, and a
greedy token is the same on both sides wherever the top two logits are more than 2 TOL apart (checked on
transformers' logits at every step: a test that could not tell is refused rather than passed).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import forkrun
import pytest
import torch
from bounds import within
from helpers import stories_or_skip
from safetensors.torch import load_file, save_file
from test_grpo_generation import train_logps

from hfmeg.errors import EngineError
from hfmeg.generation import vllm_engine
from hfmeg.generation.engine import SamplingParams

TOL = 1e-4
PROMPTS = ["Once upon a time", "Lily liked to", "The dog ran"]
HEAD_DIM = 32
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_llama.py"


def regrouped_stories(out) -> str:
    """stories260K with head_dim 32 (module docstring), saved with its tokenizer under `out`."""
    import json

    src = stories_or_skip()
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(head_dim=HEAD_DIM, num_attention_heads=cfg["hidden_size"] // HEAD_DIM, num_key_value_heads=2,
               num_hidden_layers=4)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if ".layers.4." in name:
            continue
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            t = torch.cat([t, t])
        tensors[name] = t.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, out / f)
    return str(out)


def have_vllm() -> bool:
    try:
        vllm_engine.vllm_python()
    except EngineError:
        return False
    return True


needs_vllm = pytest.mark.skipif(not have_vllm(), reason="no .venv-vllm: `make .venv-vllm` (make test makes it)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return regrouped_stories(tmp_path_factory.mktemp("hd32") / "model")


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def engine(model, tok, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm_engine.VLLMEngine(model, [tok.eos_token_id], log=log, max_model_len=256) as e:
        yield e


def hf_greedy(folder, prompt: list[int], n: int) -> list[int]:
    """transformers' `generate`, greedy, after checking every step's top-two margin exceeds the 2 TOL bound."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = m.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, output_logits=True,
                     return_dict_in_generate=True)
    for step in out.logits:
        top = step[0].float().topk(2).values
        assert top[0] - top[1] > 2 * TOL, "greedy decoding at a near tie: the comparison cannot decide"
    return out.sequences[0, len(prompt):].tolist()


def test_a_missing_environment_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HFMEG_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(EngineError, match=r"make \.venv-vllm.*--generator transformers"):
        vllm_engine.VLLMEngine(tmp_path, [2])


def test_the_recipe_without_the_environment_is_one_line_exit_2(tmp_path):
    """`--generator vllm` with no vLLM environment: refused before anything is written, with how to make it. The
    recipe runs forked (tests/forkrun.py): it exits before any tensor is computed."""
    stories = stories_or_skip()
    (tmp_path / "p.jsonl").write_text('{"prompt": "Once upon a time"}\n')
    env = {**os.environ, "HFMEG_VLLM_PYTHON": str(tmp_path / "nope" / "python")}
    proc = forkrun.run([sys.executable, str(RECIPE), "--model", str(stories), "--data", str(tmp_path / "p.jsonl"),
                        "--reward-funcs", "accuracy", "--generator", "vllm", "--tp", "1", "--seq-len", "64",
                        "--max-completion-length", "16", "--num-generations", "4", "--global-batch-size", "8",
                        "--out", str(tmp_path / "out")], env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "make .venv-vllm" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@needs_vllm
def test_greedy_equals_transformers_generate(engine, model, tok):
    prompts = [tok(p).input_ids for p in PROMPTS]
    got = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0), [0] * len(prompts))
    for c, p in zip(got, prompts):
        assert c.prompt_ids == p and len(c.logps) == len(c.completion_ids) > 0
        want = hf_greedy(model, p, 16)
        assert c.completion_ids == want[:len(c.completion_ids)]
        assert c.truncated == (len(c.completion_ids) == 16 and tok.eos_token_id not in c.completion_ids)


@needs_vllm
def test_sampling_is_seeded_per_completion(engine, tok):
    p = [tok(x).input_ids for x in PROMPTS]
    params = SamplingParams(max_new_tokens=12)
    batch = engine.generate([p[0], p[0], p[1]], params, [1, 2, 3])
    alone = engine.generate([p[0]], params, [2])[0]
    assert alone.completion_ids == batch[1].completion_ids
    assert batch[0].completion_ids != batch[1].completion_ids


@needs_vllm
def test_after_a_weight_push_the_outputs_are_the_new_weights(engine, model, tok, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    tensors = load_file(moved / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if "layers." in name and w.ndim == 2:
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=gen))
    save_file(tensors, moved / "model.safetensors", metadata={"format": "pt"})
    prompts = [tok(p).input_ids for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    before = engine.generate(prompts, greedy, [0] * 3)
    try:
        engine.load(moved)
        after = engine.generate(prompts, greedy, [0] * 3)
    finally:
        engine.load(model)  # the module's other tests expect the original weights
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]
    for c, p in zip(after, prompts):
        assert c.completion_ids == hf_greedy(moved, p, 12)[:len(c.completion_ids)]
    assert [c.completion_ids for c in engine.generate(prompts, greedy, [0] * 3)] == [c.completion_ids for c in before]


@needs_vllm
def test_generator_logps_equal_training_forward_tp2_pp2(engine, model, tok):
    """At temperature 1 and 0.7 (both sides score softmax(logits / T): within 2 TOL / T)."""
    from hfmeg.parallel.launch import spawn
    from hfmeg.train.grpo import MISMATCH

    p = [tok(x).input_ids for x in PROMPTS[:2]]
    runs = [(engine.generate([p[0]] * 2 + [p[1]] * 2, SamplingParams(max_new_tokens=16, temperature=t),
                             [5, 6, 7, 8]), t) for t in (1.0, 0.7)]
    results = [r for r in spawn(train_logps, 4, model, runs, tok.eos_token_id) if r is not None]
    assert results
    for rank in results:
        for (diffs, metrics), (completions, t) in zip(rank, runs, strict=True):
            assert len(diffs) == sum(len(c.completion_ids) for c in completions)
            within(float(diffs.abs().max()), 2 * TOL / t, "vLLM logp vs training forward", f"tp2 pp2 T={t}")
            assert metrics[MISMATCH] == pytest.approx(float(diffs.abs().mean()), rel=1e-5)


@needs_vllm
def test_a_model_vllm_cannot_serve_names_the_reason(tmp_path):
    folder = stories_or_skip()  # head_dim 8
    with pytest.raises(EngineError, match=r"vLLM cannot serve .*: .+; use --generator transformers"):
        vllm_engine.VLLMEngine(folder, [2], log=tmp_path / "vllm.log", max_model_len=256)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not left behind: it is reaped by its parent's exit
        return f.read().split()[2] != "Z"


@needs_vllm
@pytest.mark.parametrize("how", ["sigkill", "ctrl-c", "error"])
def test_no_worker_outlives_its_engine(how, model, tmp_path):
    """A process that started an engine dies by SIGKILL, Ctrl-C (SIGINT) or an exception: the worker goes too.
    The worker is stopped before its vLLM start finishes (its pid is known at once), the costliest moment to
    leak one. A worker reads no request before its start ends (vllm_worker.main), so the stop `close()` asks for
    then is never answered and the kill after the grace period is what stops it, whatever the grace: the script
    gives it 1 s (STOP_GRACE_S is 10), not 10 s more of the worker importing vLLM."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import threading, time
        from pathlib import Path
        from hfmeg.generation import vllm_engine
        vllm_engine.STOP_GRACE_S = 1.0
        real = vllm_engine.VLLMEngine._wait
        def wait(self, *a):
            Path({str(pid_file)!r}).write_text(str(self.pid))
            if {how!r} == "error":
                raise RuntimeError("boom")
            return real(self, *a)
        vllm_engine.VLLMEngine._wait = wait
        vllm_engine.VLLMEngine({model!r}, [2])
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    worker = int(pid_file.read_text())
    if how == "sigkill":
        proc.kill()
    elif how == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    proc.wait(60)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), f"vLLM worker {worker} left behind after {how}"


def _run_with(cfg, engine):
    sys.path.insert(0, str(RECIPE.parent))  # the toy reward's module
    from hfmeg.train.grpo_trainer import GRPOTrainer

    GRPOTrainer(cfg, engine=engine).run()


@needs_vllm
def test_a_grpo_run_with_vllm_at_tp2_pp2_matches_one_process(engine, model, tmp_path):
    """test_grpo_train.py's run and bounds with the vLLM engine (the module's, handed to both runs: rank 0 of each
    pushes its weights into it every step): the same completions and rewards, losses and gradient norms within
    their bounds, the mismatch within 2 TOL."""
    from dataclasses import replace

    from test_grpo_train import _config, _prompts, _rows, check_layouts_agree

    from hfmeg.parallel.launch import spawn

    data = _prompts(tmp_path)
    try:
        for name, tp, pp in (("single", 1, 1), ("grid", 2, 2)):
            cfg = _config(tmp_path / name, data, tp=tp, pp=pp, generator="vllm")
            spawn(_run_with, tp * pp, replace(cfg, model=replace(cfg.model, path=model)), engine, timeout_s=1200)
    finally:
        engine.load(model)  # the module's other tests expect the original weights
    check_layouts_agree(_rows(tmp_path / "single"), _rows(tmp_path / "grid"), 3)
    assert "generated by a vLLM engine" in (tmp_path / "grid" / "hf" / "README.md").read_text()


def _killed_in(cfg, doing: str, at_call: int, pid_file: Path):
    """A run that starts its own engine, SIGKILLed once its `at_call`-th request of `doing` ("generating", "loading
    the weights") is sent: the worker is at that request (or about to read it) when the run dies. The worker's pid
    goes to `pid_file` first, for the test to check it went too."""
    real, calls = vllm_engine.VLLMEngine._wait, []

    def wait(self, timeout, what):
        if what.startswith(doing):
            calls.append(1)
            if len(calls) == at_call:
                pid_file.write_text(str(self.pid))
                os.kill(os.getpid(), signal.SIGKILL)
        return real(self, timeout, what)

    vllm_engine.VLLMEngine._wait = wait
    _run_with(cfg, None)


@pytest.fixture(scope="module")
def straight_rows(engine, model, tmp_path_factory):
    """Four uninterrupted steps with the module's engine (the resume tests' reference)."""
    from test_grpo_train import _rows

    from hfmeg.parallel.launch import spawn

    root = tmp_path_factory.mktemp("straight")
    try:
        spawn(_run_with, 1, _vllm_config(root / "out", root, model), engine, timeout_s=1200)
    finally:
        engine.load(model)
    return _rows(root / "out")


def _vllm_config(out: Path, root: Path, model: str, **checkpoint):
    from dataclasses import replace

    from test_grpo_train import _config, _prompts

    cfg = _config(out, _prompts(root), steps=4, generator="vllm")
    return replace(cfg, model=replace(cfg.model, path=model), checkpoint=replace(cfg.checkpoint, **checkpoint))


@needs_vllm
@pytest.mark.parametrize("doing, at_call", [("generating", 3), ("loading the weights", 2)])
def test_a_kill_during_generation_or_a_weight_push_resumes_to_the_uninterrupted_losses(
        doing, at_call, straight_rows, engine, model, tmp_path):
    """test_grpo_train.py's resume test with the vLLM engine: a run (its own engine, started at step 1) SIGKILLed while
    its worker generates step 3's completions (its 3rd generate) or loads step 3's weights (its 2nd load: step 1
    started the engine on them) leaves no worker behind; resumed from step 2's checkpoint (with the module's engine)
    it has the uninterrupted run's rewards, losses and gradient norms exactly: the same exported weights and seeds
    give vLLM's same completions, and the training is the same fp32 arithmetic in one process."""
    from test_grpo_train import _rows

    from hfmeg.parallel.launch import WorkerError, spawn

    out, pid_file = tmp_path / "killed", tmp_path / "worker.pid"
    with pytest.raises(WorkerError):
        spawn(_killed_in, 1, _vllm_config(out, tmp_path, model, save_every=1), doing, at_call, pid_file,
              timeout_s=1200)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), f"vLLM worker {worker} left behind after a kill while {doing}"
    assert [r["step"] for r in _rows(out)] == [1, 2]
    try:
        spawn(_run_with, 1, _vllm_config(out, tmp_path, model, save_every=1, resume="auto"), engine, timeout_s=1200)
    finally:
        engine.load(model)
    got = _rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for x, y in zip(straight_rows, got, strict=True):
        for k in ("reward", "completions/mean_length", "loss", "grad_norm"):
            assert x[k] == y[k], (k, x["step"])


@needs_vllm
def test_grpo_learns_at_tp2_pp2_each_step_as_one_process(engine, model, tmp_path):
    """test_grpo_train.py's learning check with the vLLM engine (the module's, every run pushing its weights into it)
    on a reward the regrouped model can learn (`grpo_toy_rewards:the`; docs/grpo.md's vLLM run, shorter)."""
    from dataclasses import replace

    from test_grpo_train import LEARN_STEPS, _config, _prompts, check_learns_and_each_step_is_one_process

    data = _prompts(tmp_path)

    def cfg_of(out, tp, pp):
        cfg = _config(out, data, tp=tp, pp=pp, steps=LEARN_STEPS, generator="vllm", reward_funcs=["grpo_toy_rewards:the"])
        return replace(cfg, model=replace(cfg.model, path=model), optim=replace(cfg.optim, lr=2e-3),
                       lr=replace(cfg.lr, decay="constant"))

    try:
        check_learns_and_each_step_is_one_process(tmp_path, _run_with, cfg_of, engine)
    finally:
        engine.load(model)  # the module's other tests expect the original weights
