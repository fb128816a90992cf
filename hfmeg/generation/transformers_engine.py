"""An in-process transformers model as a generation engine (engine.py's interface).

Decoding is a plain loop over the model's forward with its KV cache, so that each completion's
sampling draws from its own seeded generator and its log-probabilities come from the same logits
it samples from. Per step: the next-token logits (fp32), the log-softmax of logits / temperature (the reported
log-probability of the chosen token; of the logits at temperature 0), and the token: the argmax at temperature 0,
else a draw from softmax(logits / temperature) restricted to the top-k tokens and to the smallest set whose
probability reaches top-p (both as transformers' and vLLM's samplers define them). A finished
completion (its end-of-sequence token emitted) is padded until every completion of the batch is.

Weights: the model is built once from an HF folder (`from_pretrained`); later weights are copied into it in place,
from a folder (`load`) or handed over as tensors (`load_tensors`: the trainer's live weights, no file written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from ..data.rollouts import Completion
from ..errors import EngineError
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
        self.model, self.in_place = None, True
        self.load(folder)

    def load(self, folder: Path) -> None:
        """The weights of `folder`: the first time the model built from it, then its tensors copied into that model
        (`load_tensors`); every parameter must come from `folder`, or share its storage with one that does (tied
        embeddings). Where the folder's tensors are not the model's own (`in_place` False: transformers converts
        some families' weights as it loads them, a Mixtral's per-expert matrices become one fused tensor), each
        load builds the model again."""
        from safetensors import safe_open
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        files = sorted(Path(folder).glob("*.safetensors"))
        if self.model is None or not self.in_place:
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
            if getattr(self.model.config, "output_router_logits", False):  # an MoE's load-balancing loss: not
                self.model.config.output_router_logits = False  # for sampling (transformers' fails on a padded batch)
            self.targets = self.model.state_dict()  # views of its tensors: copies into them go into the model
            stored = {k for f in files for k in safe_open(f, "pt").keys()}
            self.in_place = stored <= set(self.targets)  # the stored names are the model's: loads copy in place
            return
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f, device=str(self.device)))
        loaded = {self.targets[k].data_ptr() for k in state if k in self.targets}
        absent = [k for k, p in self.model.named_parameters(remove_duplicate=False) if p.data_ptr() not in loaded]
        unexpected = [k for k in state if k not in self.targets]
        if unexpected or absent:
            raise EngineError(f"{folder}: weights do not fit the engine's model (absent {absent[:3]}, "
                              f"unexpected {unexpected[:3]})")
        self.load_tensors(state.items(), str(folder))

    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "the pushed weights") -> None:
        """New values of the model's tensors by HF name, copied in place (a weight push without files,
        train/rollout.py: only what changed need come). A push changes the weights, never the architecture, so
        the model is built once; building it again (`from_pretrained`) cost more than a step's sampling."""
        with torch.no_grad():
            for name, t in tensors:
                target = self.targets.get(name)
                if target is None or target.shape != t.shape:
                    what = "unexpected" if target is None else f"shaped {list(t.shape)}, not {list(target.shape)},"
                    raise EngineError(f"{source}: weights do not fit the engine's model ({what} {name})")
                target.copy_(t)

    def close(self) -> None:
        self.model = self.targets = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        # Every completion in one batch, prompts left-padded (as transformers' `generate` batches them): one forward
        # a token for the whole step, where a forward per prompt group cost the step one forward per group and token.
        # Padded keys are masked and each row's positions count its own tokens only, so a row's numbers differ
        # from its batch of one by the matmuls' rounding alone; the same batch gives the same completions on every
        # layout and on resume (the engine runs on one rank, and each row draws from its own seeded generator).
        n, width = len(prompts), max(len(p) for p in prompts)
        gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        step_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        tokens = torch.empty(n, 0, dtype=torch.long, device=self.device)
        logps = torch.empty(n, 0, device=self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        eos = self.eos.to(self.device)
        for _ in range(params.max_new_tokens):
            res = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache,
                             use_cache=True)
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
            step_ids, positions = nxt[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out, eos_ids = [], set(self.eos.tolist())
        for r, prompt in enumerate(prompts):
            row = tokens[r].tolist()
            ends = [k for k, t in enumerate(row) if t in eos_ids]
            length = ends[0] + 1 if ends else len(row)
            out.append(Completion(list(prompt), row[:length], logps[r, :length].tolist(), truncated=not ends))
        return out
