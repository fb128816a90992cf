"""The gated delta rule of Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024) in chunked form, and its short causal
convolution, both reset at every document start of a packed row.

Per head the state S (`[dk, dv]`) follows, token by token,

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t,

with a_t = exp(g_t) <= 1 the decay and beta_t in (0, 1) the write strength. A document start cuts the state
(a_t = 0 there): the row computes what each document alone computes. Unrolled over a chunk of C tokens that
enters with state S_0, with D_tj the decay from token j to token t (the product of a over (j, t], 0 across a
document start) and D_t0 the decay from the chunk's start (0 when a document starts in [1, t]):

    u_t + sum_{j<t} beta_t D_tj (k_t . k_j) u_j = beta_t v_t - beta_t D_t0 k_t^T S_0,

a unit lower-triangular system T U = beta V - (beta D_0 K) S_0, solved once per chunk for both right-hand
sides (`new` = T^-1 beta V, `w` = T^-1 beta D_0 K). Then o_t = D_t0 S_0^T q_t + sum_{j<=t} D_tj (q_t . k_j) u_j,
and the state leaving the chunk is D_C0 S_0 + sum_j D_Cj k_j u_j^T: the only sequential step is that one
state per chunk. The decays are summed in log space within each document only (a masked sum, not a row
cumsum), so a long earlier document does not cost the later ones precision; pairs across a start are masked
to -inf before `exp`.

Everything here runs in fp32. Padding the row to whole chunks with g = 0 and beta = 0 leaves the state as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def document_runs(segment_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document `[b, s]`, counted along the row: a new one wherever the segment id changes (a
    packed row's documents are runs of one id)."""
    change = torch.ones_like(segment_ids, dtype=torch.bool)
    change[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return change.long().cumsum(-1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of `x` `[b, s, c]` with `weight` `[c, K]` (tap K - 1 on the
    current token, as `nn.Conv1d` with K - 1 left padding), reading no token of an earlier document (`docs`:
    `document_runs`, None: one document a row)."""
    K, s = weight.shape[-1], x.shape[1]
    padded = F.pad(x, (0, 0, K - 1, 0))
    out = x * weight[:, K - 1]
    if docs is not None:
        padded_docs = F.pad(docs, (K - 1, 0), value=-1)
    for back in range(1, K):
        past = padded[:, K - 1 - back: K - 1 - back + s]
        if docs is not None:
            past = past * (padded_docs[:, K - 1 - back: K - 1 - back + s] == docs).unsqueeze(-1).to(x.dtype)
        out = out + past * weight[:, K - 1 - back]
    return F.silu(out)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           docs: torch.Tensor | None, chunk: int = CHUNK) -> torch.Tensor:
    """The outputs `[b, h, s, dv]` of the rule (module doc) for q, k `[b, h, s, dk]` (normalised and scaled as the
    caller wants them), v `[b, h, s, dv]`, log-decays g and strengths beta `[b, h, s]`, all fp32; `docs` `[b, s]`
    (`document_runs`; None: one document a row). The state starts at zero in each row."""
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk
    if docs is None:
        docs = torch.zeros(b, s, dtype=torch.long, device=q.device)
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    docs = torch.cat([docs, docs[:, -1:].expand(b, pad)], dim=1)  # padding continues the last document
    n = (s + pad) // chunk
    q, k, v = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    d = docs.reshape(b, 1, n, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    same = (d.unsqueeze(-1) == d.unsqueeze(-2)) & causal  # [b, 1, n, C, C]: j <= t in t's document
    cum = (same.to(g.dtype) @ g.unsqueeze(-1)).squeeze(-1)  # log-decay from t's document's first token in the chunk
    decay = torch.exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~same, float("-inf")))  # D_tj
    # The document the chunk enters in: that of the previous chunk's last token (chunk 0 enters with a zero state).
    entering = torch.cat([d[:, :, :1, :1], d[:, :, :-1, -1:]], dim=2)
    from_start = torch.exp(cum) * (d == entering)  # D_t0
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle is T - I (diagonal not read)
    new = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * from_start.unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_in = q * from_start.unsqueeze(-1)
    k_out = k * decay[..., -1, :].unsqueeze(-1)  # D_Cj k_j
    state = q.new_zeros(b, h, dk, dv)
    out = []
    for i in range(n):
        u = new[:, :, i] - w[:, :, i] @ state
        out.append(q_in[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * from_start[:, :, i, -1, None, None] + k_out[:, :, i].transpose(-1, -2) @ u
    return torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :s]
