"""gpt-oss (`hfmeg/families/gpt_oss.py`): its config reader, bit-exact conversion at TP2 x PP2 and EP2, and parity
with transformers on packed rows at TP {1, 2} x EP {1, 2} (SP, PP2 too): logits, the loss with the load-balancing
term, every gradient.

The tiny model (`tests/tiny_models.py`) has all of gpt-oss's maths on: attention sinks, Q/K/V/O biases, a window of 4
tokens on its sliding layers (shorter than the packed documents), YaRN, the router's bias, the experts' biases
and a SwiGLU clamp that bites. transformers' `GptOssModel` builds no packed-document mask from position ids, so the
reference is given the packed rows' masks itself (its mask mapping per layer type, additive), and its loss is
assembled as `GptOssForCausalLM` assembles it: cross-entropy plus `router_aux_loss_coef` times its own
`load_balancing_loss_func` over every layer's router logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

from bounds import parity_bounds, within
from convert_helpers import assert_same_tensors
from helpers import gather_tp, make_ps
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_layout import iteration_dir_name
from hfmeg.checkpoint.mp_save import chunks_layout, staged_save, write_model_shard
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.data.microbatch import MicroBatch
from hfmeg.families import model_config_from_hf
from hfmeg.models.generate import greedy_generate
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.stored_names import stored_tensors

from tiny_models import WINDOW, save_tiny, tiny_config

LAYER_TYPES = ["sliding_attention", "full_attention"] * 2
# (tp, pp, sp, ep) in a world of 4 (the rest DP)
LAYOUTS = [(1, 1, False, 1), (2, 1, False, 1), (2, 1, True, 1), (1, 1, False, 2), (2, 1, True, 2), (1, 2, False, 2),
           (2, 2, True, 1)]
VOCAB = 300
GENERATE = ((2, 1, False, 1), (1, 1, False, 2))  # layouts that also generate greedily, past the window
PROMPT = torch.tensor([[5, 17, 42, 7, 99]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return save_tiny("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "m", num_hidden_layers=4, layer_types=LAYER_TYPES)


def test_config_reader_switches_gpt_oss_maths_on():
    cfg = model_config_from_hf(tiny_config("gpt_oss", num_hidden_layers=4, layer_types=LAYER_TYPES))
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.out_bias and cfg.norm_fp32_scale and not cfg.mlp_bias
    assert [cfg.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    m = cfg.moe
    assert (m.router_bias, m.expert_bias, m.swiglu_alpha, m.swiglu_limit) == (True, True, 1.702, 0.1)
    assert (m.num_experts, m.top_k, m.norm_topk_prob, m.sparse_layers) == (4, 2, True, [0, 1, 2, 3])
    assert cfg.to_dict()["attn_sinks"] and cfg.to_dict()["moe"]["swiglu_limit"] == 0.1
    # openai's MXFP4 release converts directly (tests/test_quantized_releases.py)


def test_round_trip_bit_exact_at_tp2_pp2(gpt_oss, tmp_path):
    hf_to_mp(gpt_oss, tmp_path / "mp", tp=2, pp=2)
    mp_to_hf(tmp_path / "mp", tmp_path / "hf")
    assert assert_same_tensors(gpt_oss, tmp_path / "hf") > 0


def _ep2_save(folder, out):
    ps = make_ps(ep=2)
    chunks = load_chunks(HFCheckpoint(folder), ps)
    layout = chunks_layout(chunks, ps, 1)
    with staged_save(layout, ps, out, folder) as staged:
        write_model_shard(chunks, ps, layout, staged)
    if dist.get_rank() == 0:
        mp_to_hf(out / iteration_dir_name(1), out / "hf")
    dist.barrier()


def test_round_trip_bit_exact_from_an_ep2_save(gpt_oss, tmp_path):
    spawn(_ep2_save, 2, gpt_oss, tmp_path / "ep2")
    assert assert_same_tensors(gpt_oss, tmp_path / "ep2" / "hf") > 0


def _packed():
    """Two rows of 24 tokens: documents of 10 + 14 and 17 + 7, each longer than the window."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    lengths = ((10, 14), (17, 7))
    seg = torch.tensor([[d + 1 for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    pos = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    labels = torch.where(torch.cat([seg[:, 1:] == seg[:, :-1], torch.zeros(2, 1, dtype=torch.bool)], 1),
                         torch.cat([ids[:, 1:], ids[:, :1]], 1), -100)
    return ids, pos, seg, labels


def _reference(folder, tmp, dtype=torch.float32):
    """transformers on the packed rows: (logits, loss, gradients under the checkpoint's names)."""
    ids, pos, seg, labels = _packed()
    # transformers' grouped-GEMM experts have no float64 kernel; its eager loop is the same arithmetic
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").to(dtype)
    cfg = model.config
    back = pos[:, :, None] - pos[:, None, :]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (back >= 0)
    masks = {t: torch.zeros(allowed.shape, dtype=dtype).masked_fill(~a, float("-inf"))[:, None]
             for t, a in (("full_attention", allowed), ("sliding_attention", allowed & (back < cfg.sliding_window)))}
    out = model.model(input_ids=ids, attention_mask=masks, position_ids=pos, output_router_logits=True)
    logits = model.lm_head(out.last_hidden_state)
    aux = load_balancing_loss_func(out.router_logits, cfg.num_local_experts, cfg.num_experts_per_tok)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) + cfg.router_aux_loss_coef * aux
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(tmp / str(dtype))
    return logits.detach(), loss.item(), load_file(tmp / str(dtype) / "model.safetensors")


def _bounds(folder, tmp, ref32) -> dict[str, float]:
    """bounds.parity_bounds from transformers' float64 run; a stacked expert tensor's gradient is compared an
    expert's slice at a time (`_grad_diff`), so its rounding is measured per slice too."""
    def per_expert(run):
        logits, loss, grads = run
        return logits, loss, {f"{n}[{e}]": g[e] for n, g in grads.items() if ".experts." in n for e in range(len(g))} | {
            n: g for n, g in grads.items() if ".experts." not in n}
    return parity_bounds(per_expert(ref32), per_expert(_reference(folder, tmp, torch.float64)))


def _grad_diff(chunks, ps, ref_grads):
    """(worst relative gradient difference per HF tensor, HF names compared); an expert's rule is its slice of the
    stacked tensor."""
    worst, seen = 0.0, set()
    for chunk in chunks:
        grads = stored_tensors(chunk, lambda p: p.main_grad)
        for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
            for name, g in to_hf(rule, gather_tp(grads[rule.local], ps), chunk.cfg).items():
                ref = ref_grads[name] if rule.expert is None else ref_grads[name][rule.expert]
                worst = max(worst, ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
                seen.add(name)
    return worst, seen


def _check_layouts(folder, ref_logits, ref_grads):
    ids, pos, seg, labels = _packed()
    rows = []
    for tp, pp, sp, ep in LAYOUTS:
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
        chunks = load_chunks(HFCheckpoint(folder), ps)
        row = dict(layout=(tp, pp, sp, ep))
        if pp == 1:
            with torch.no_grad():
                logits = torch.cat(gather_tp(chunks[0](ids, position_ids=pos, segment_ids=seg), ps), dim=-1)
            row["logit_diff"] = (logits[..., :VOCAB] - ref_logits).abs().max().item()
        # Every DP replica takes the same rows, 1/dp of the loss each; the wrapper sums the gradients as training does.
        wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
        mb = MicroBatch(input_ids=ids, labels=labels, position_ids=pos, segment_ids=seg)
        loss = forward_backward(chunks, ps, [mb], schedule="1f1b", num_tokens=int((labels != -100).sum()) * ps.dp,
                                grad_sync=wrapper)
        wrapper.finish_grad_sync()
        row["grad_rel"], row["seen"] = _grad_diff(chunks, ps, ref_grads)
        if loss is not None:
            row["loss"] = loss * ps.dp
        if (tp, pp, sp, ep) in GENERATE:
            row["generated"] = greedy_generate(chunks, ps, PROMPT, NEW_TOKENS).tolist()
        rows.append(row)
    return rows


def test_packed_rows_match_transformers(gpt_oss, tmp_path):
    """Logits (PP 1), loss and every gradient within rounding (bounds.parity_bounds) of transformers' in fp32; greedy
    generation (transformers' with its cache) the same tokens."""
    ref_logits, ref_loss, ref_grads = ref = _reference(gpt_oss, tmp_path / "ref")
    bounds = _bounds(gpt_oss, tmp_path / "ref", ref)
    model = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32, attn_implementation="eager")
    expected = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    results = spawn(_check_layouts, 4, str(gpt_oss), ref_logits, ref_grads)
    for layout in LAYOUTS:
        rows = [r for rank in results for r in rank if r["layout"] == layout]
        assert set().union(*(r["seen"] for r in rows)) == set(ref_grads), layout
        assert any("loss" in r for r in rows), layout
        for r in rows:
            within(r["grad_rel"], bounds["grad_rel"], "grad_rel", r)
            if "logit_diff" in r:
                within(r["logit_diff"], bounds["logit_diff"], "logit_diff", r)
            if "loss" in r:
                within(abs(r["loss"] - ref_loss), bounds["loss_diff"], "loss_diff", r)
            if "generated" in r:
                assert r["generated"] == expected, (r["generated"], expected)
    assert sum("generated" in r for rank in results for r in rank) == 4 * len(GENERATE)
