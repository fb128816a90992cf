"""An in-process transformers model as a generation engine (engine.py's interface).

Decoding is a plain loop over the model's forward with its KV cache, so that each completion's
sampling draws from its own seeded generator and its log-probabilities come from the same logits
it samples from. Per step: the next-token logits (fp32), the log-softmax of logits / temperature (the reported
log-probability of the chosen token; of the logits at temperature 0), and the token: the argmax at temperature 0,
else a draw from softmax(logits / temperature) restricted to the top-k tokens and to the smallest set whose
probability reaches top-p (both as transformers' and vLLM's samplers define them). A finished
completion (its end-of-sequence token emitted) is padded until every completion of the batch is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.rollouts import Completion
from .engine import SamplingParams


def filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` `[n, V]` with the tokens outside top-k and outside the top-p nucleus at -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class TransformersEngine:
    """`AutoModelForCausalLM` of an HF folder, fp32, on `device`; `eos_ids` end a completion, `pad_id` fills after."""

    def __init__(self, folder: Path, eos_ids: list[int], pad_id: int, device: str | torch.device = "cpu"):
        self.eos, self.pad_id, self.device = torch.tensor(eos_ids), pad_id, torch.device(device)
        self.model = None
        self.load(folder)

    def load(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        # One prompt's completions at a time: a batch of equal-length rows needs no padding and no attention mask,
        # so each completion's numbers are those of a batch of one.
        out: list[Completion | None] = [None] * len(prompts)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(p), []).append(i)
        for prompt, rows in groups.items():
            for i, c in zip(rows, self._sample(list(prompt), params, [seeds[i] for i in rows])):
                out[i] = c
        return out

    def _sample(self, prompt: list[int], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        n = len(seeds)
        gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        ids = torch.tensor([prompt] * n, device=self.device)
        cache, step_ids = None, ids
        tokens = torch.empty(n, 0, dtype=torch.long, device=self.device)
        logps = torch.empty(n, 0, device=self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        eos = self.eos.to(self.device)
        for _ in range(params.max_new_tokens):
            res = self.model(input_ids=step_ids, cache=cache, use_cache=True)
            cache = res.cache
            logits = res.logits[:, -1].float()
            scaled = logits / params.temperature if params.temperature else logits
            if params.temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = filtered(scaled, params.top_k, params.top_p).softmax(-1)
                nxt = torch.stack([torch.multinomial(probs[r], 1, generator=gens[r])[0] for r in range(n)])
            nxt = torch.where(done, self.pad_id, nxt)
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            logps = torch.cat([logps, scaled.log_softmax(-1).gather(-1, nxt[:, None])], 1)
            done |= torch.isin(nxt, eos)
            if done.all():
                break
            step_ids = nxt[:, None]
        out = []
        for r in range(n):
            row = tokens[r].tolist()
            ends = [k for k, t in enumerate(row) if t in self.eos.tolist()]
            length = ends[0] + 1 if ends else len(row)
            out.append(Completion(prompt, row[:length], logps[r, :length].tolist(), truncated=not ends))
        return out
