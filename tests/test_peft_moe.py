"""LoRA on MoE models (experts and router) under expert parallelism vs `peft` on transformers (fp32).

transformers v5 stacks the experts and peft adapts them with LoRA on those parameters (`target_parameters`);
the adapters here are made by `peft` itself (`init_lora_weights=False`: A and B random, so every gradient is
non-zero) and read through `peft.init_from`'s path:
- tiny gpt-oss (all-linear, which peft takes there as attention only: its router and experts are not
  `nn.Linear`s, and peft maps no names onto them);
- tiny Mixtral (all-linear: attention, router, experts; q/v + w2 alone with rslora, the other PEFT key
  nesting; q + w1/w3 with the router in `modules_to_save`, trained in full), tiny Qwen3-MoE (all-linear; its
  dense layer 0 gets attention adapters only, as in peft) and tiny Qwen2-MoE (all-linear, which peft takes there
  as attention, the dense layer 0's MLP, the shared expert's gate/up/down and `shared_expert_gate`; and
  `modules_to_save: [gate]`, which peft's suffix match takes as the router and `shared_expert_gate`) and tiny
  DeepSeek-V3 (all-linear: MLA's five projections, router, routed experts; not its dense layer's MLP nor its shared
  experts, as in peft; also at TP2 without SP), one 4-process
  world: EP 1, 2, 4, EP2 x TP2 (SP) and EP2 x PP2: logits, loss (with the load-balancing term)
  and every adapter gradient, the experts' pieces gathered over EP and joined as the export joins them;
- the shards written at EP2 (DP rank 0's file plus the other EP rank's experts file) export back bit-exact to
  the file peft wrote, the folder loads with `PeftModel.from_pretrained` to the same logits, and EP4 and EP1
  chunks read the EP2-written shards (the per-expert stored names) to the same values;
- the merged folder (per-expert HF names, v4's `block_sparse_moe.gate` for a saved Mixtral router, the shared
  expert) equals peft's adapter-on-base logits;
- a few training steps at EP2 x DP2 (and EP2 x TP2) with the distributed optimizer vs one process of peft +
  torch AdamW: losses and every trained adapter tensor;
- refusals: DoRA or dropout on experts or the shared expert, w1 without w3, a target that matches nothing,
  Qwen2-MoE's and gpt-oss's routed experts, a module both adapted and in modules_to_save, an MoE module_to_save the
  model lacks (gpt-oss's `gate`: its router is `mlp.router`, with a bias).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import make_ps
from optim_harness import CFG, batch, global_tokens, train
from peft_helpers import (full_adapter_grads, hfmeg_chunks, make_base_and_adapter, merged_vs_peft, peft_adapter_grads,
                          peft_reference, rel_diff, replica_step)
from safetensors.torch import load_file
from tiny_models import save_tiny

from hfmeg.checkpoint.convert import load_model_config
from hfmeg.errors import UnsupportedConfigError
from hfmeg.models.generate import full_logits
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.stored_names import stored_tensors
from hfmeg.peft.adapter_files import (WEIGHTS_FILE, assemble, read_adapter_shard, write_adapter_shard, write_peft_folder)
from hfmeg.peft.adapters import adapter_tensors, check_model
from hfmeg.peft.config import PeftConfig

LAYOUTS = [(1, 1, False, 2), (1, 1, False, 1), (2, 1, True, 2), (1, 2, False, 2), (1, 1, False, 4)]  # tp pp sp ep
TOL = 1e-4
# per model kind, beyond all-linear: (targets, rslora, modules_to_save)
MORE_CASES = {"mixtral": [(["q_proj", "v_proj", "w2"], True, None), (["q_proj", "w1", "w3"], False, ["gate"])],
              "qwen2_moe": [(["q_proj", "gate_proj", "up_proj", "down_proj"], False, ["gate"])]}


def _cases(root: Path, kind: str):
    return [make_base_and_adapter(root, kind)] + [
        make_base_and_adapter(root, kind, targets=t, rslora=rs, modules_to_save=save)
        for t, rs, save in MORE_CASES.get(kind, [])]


def _reference(base, adapter, ids):
    model = peft_reference(base, adapter)
    out = model(input_ids=ids, labels=ids)  # the load-balancing term included, as hfmeg's pipeline adds it
    out.loss.backward()
    return out.logits.detach(), out.loss.item(), peft_adapter_grads(model)


def _check(cases, ids, refs, layouts):
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    rows = []
    for (base, adapter), (ref_logits, ref_loss, ref_grads) in zip(cases, refs):
        shards = Path(f"{adapter}_shards_ep2")
        for tp, pp, sp, ep in layouts:
            ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
            chunks, cfg = hfmeg_chunks(base, adapter, ps)
            logits = full_logits(chunks, ps, ids)
            loss, grads = replica_step(chunks, ps, ids, labels)
            row = dict(case=adapter, layout=(tp, pp, sp, ep), grads=sorted(grads),
                       grad_rel=max(rel_diff(g, ref_grads[k]) for k, g in grads.items()))
            if logits is not None:
                row.update(logit_diff=(logits - ref_logits).abs().max().item(), loss_diff=abs(loss * ps.dp - ref_loss))
            if (tp, pp, sp, ep) == (1, 1, False, 2):  # EP2 shards: DP0's file + the other EP rank's experts
                write_adapter_shard(chunks, ps, shards / "mp_rank_00")
                dist.barrier()
                if ps.rank == 0:
                    back = write_peft_folder(Path(f"{shards}_back"), assemble(shards), cfg, str(base))
                    source, again = (load_file(str(Path(f) / WEIGHTS_FILE)) for f in (adapter, back))
                    row["exact"] = source.keys() == again.keys() and all(torch.equal(source[k], again[k])
                                                                         for k in source)
                    with torch.no_grad():
                        row["export_logits"] = (peft_reference(base, back, False)(ids).logits - ref_logits).abs().max().item()
            if (tp, pp, sp) == (1, 1, False) and ep in (1, 4):  # the EP2-written shards at another EP size
                values = {t.local: stored_tensors(c)[t.local].clone() for c in chunks for t in adapter_tensors(c)}
                with torch.no_grad():
                    for c in chunks:
                        for p in c.parameters():
                            if p.requires_grad:
                                p.zero_()
                read_adapter_shard(chunks, shards / "mp_rank_00", 0)
                row["reread"] = all(torch.equal(stored_tensors(c)[t.local], values[t.local])
                                    for c in chunks for t in adapter_tensors(c))
            rows.append(row)
    return rows


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_moe_lora_matches_peft_under_ep(kind, tmp_path):
    cases = _cases(tmp_path, kind)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    refs = [_reference(b, a, ids) for b, a in cases]
    # DeepSeek-V3: TP2 without SP too, where MLA's replicated a-projections see every token (`_Base.whole_partial`)
    layouts = LAYOUTS + [(2, 1, False, 1)] if kind == "deepseek_v3" else LAYOUTS
    results = spawn(_check, 4, [(str(b), str(a)) for b, a in cases], ids, refs, layouts)
    for (base, adapter), ref in zip(cases, refs):
        for layout in layouts:
            rows = [r for rank in results for r in rank if r["case"] == str(adapter) and r["layout"] == layout]
            assert sorted({g for r in rows for g in r["grads"]}) == sorted(ref[2]), layout
            assert any("logit_diff" in r for r in rows)
            for r in rows:
                assert r["grad_rel"] <= TOL, r
                assert r.get("logit_diff", 0) <= TOL and r.get("loss_diff", 0) <= 1e-5, r
                assert r.get("exact", True) and r.get("export_logits", 0) <= TOL and r.get("reread", True), r
        assert any(r.get("exact") for rank in results for r in rank if r["case"] == str(adapter))
        assert any(r.get("reread") for rank in results for r in rank if r["case"] == str(adapter))


@pytest.mark.parametrize("kind, case", [("mixtral", None), ("mixtral", 1), ("qwen2_moe", None), ("gpt_oss", None),
                                        ("deepseek_v3", None)])
def test_moe_merge_matches_peft_on_the_base(kind, case, tmp_path):
    t, rs, save = MORE_CASES[kind][case] if case is not None else ("all-linear", False, None)
    base, adapter = make_base_and_adapter(tmp_path, kind, targets=t, rslora=rs, modules_to_save=save)
    assert merged_vs_peft(base, adapter, tmp_path / "merged") <= TOL


STEPS, GA = 4, 2
TRAIN_LAYOUTS = [(1, 1, False, 2), (2, 1, True, 2)]  # EP2 x DP4 (expert-DP 2), EP2 x TP2 x DP2


def _peft_adamw(base, adapter):
    """One process: peft + torch AdamW over the harness's global batches (every adapter tensor decays)."""
    model = peft_reference(base, adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    o = OptimizerConfig(**CFG)
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    losses = []
    for step in range(STEPS):
        ntok, total = global_tokens(step, GA), 0.0
        for m in range(GA):
            ids, labels = batch(step, m)
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / ntok
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    named = {n.replace(".default", ""): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return losses, named


def _train(base, adapter, ref_params):
    rows = []
    for tp, pp, sp, ep in TRAIN_LAYOUTS:
        ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
        chunks, _ = hfmeg_chunks(base, adapter, ps)
        opt = DistributedOptimizer(chunks, ps, OptimizerConfig(mode="overlapped", **CFG))
        losses = train(chunks[0], opt, ps, GA, STEPS)
        opt.wait_params()
        finals = full_adapter_grads(chunks, ps, lambda p: p.detach())  # the trained adapters, as PEFT tensors
        rows.append(dict(layout=(tp, pp, sp, ep), losses=losses, names=sorted(finals),
                         param_rel=max(rel_diff(v, ref_params[k]) for k, v in finals.items())))
    return rows


def test_moe_lora_training_matches_peft_adamw(tmp_path):
    save_tiny("mixtral", tmp_path / "mixtral_base", output_router_logits=False)
    base, adapter = make_base_and_adapter(tmp_path, "mixtral")
    ref_losses, ref_params = _peft_adamw(base, adapter)
    results = spawn(_train, 4, str(base), str(adapter), ref_params)
    for rank in results:
        for r in rank:
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses))
            assert rel <= TOL, (r["layout"], r["losses"], ref_losses)
            assert r["names"] == sorted(ref_params) and r["param_rel"] <= TOL, r
    start = load_file(str(adapter / WEIGHTS_FILE))
    assert min(rel_diff(ref_params[k], start[k]) for k in start) > 1e-4  # every adapter tensor was trained


def test_moe_lora_refusals(tmp_path):
    mixtral = load_model_config(save_tiny("mixtral", tmp_path / "m"))
    llama = load_model_config(save_tiny("llama3", tmp_path / "l"))
    qwen2 = load_model_config(save_tiny("qwen2_moe", tmp_path / "q"))
    gpt_oss = load_model_config(save_tiny("gpt_oss", tmp_path / "g"))
    lora = PeftConfig(method="lora", target_modules=["all-linear"])
    shared = replace(lora, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    for model, cfg, field in [
        (mixtral, replace(lora, method="dora"), "peft.method: dora is not supported on MoE experts"),
        (mixtral, replace(lora, dropout=0.1), "peft.dropout"),
        (mixtral, replace(lora, target_modules=["w1", "w2"]), "peft.target_modules: w1 without w3"),
        (mixtral, replace(lora, target_modules=["q_proj", "gate_proj"]), "peft.target_modules: ['gate_proj']"),
        (llama, replace(lora, target_modules=["q_proj", "w1"]), "peft.target_modules: ['w1']"),
        (qwen2, replace(lora, target_modules=["q_proj", "gate_up_proj"]),
         "peft.target_modules: ['gate_up_proj'] on qwen2_moe"),
        (qwen2, replace(shared, method="dora"), "peft.method: dora is not supported on the shared expert"),
        (qwen2, replace(shared, dropout=0.1), "peft.dropout is not supported on the shared expert"),
        (mixtral, replace(lora, modules_to_save=["gate"]), "peft.modules_to_save: ['gate'] and peft.target_modules "
                                                           "both take ['gate.weight']"),
        (qwen2, replace(lora, modules_to_save=["gate"]), "both take ['shared_expert_gate']"),
        (llama, replace(lora, modules_to_save=["gate"]), "peft.modules_to_save: gate is not a module"),
        (mixtral, replace(shared, modules_to_save=["shared_expert_gate"]),
         "peft.modules_to_save: shared_expert_gate is not a module"),
        (gpt_oss, replace(lora, target_modules=["q_proj", "gate_up_proj"]),
         "peft.target_modules: ['gate_up_proj'] on gpt_oss"),
        (gpt_oss, replace(lora, target_modules=["q_proj", "down_proj"]), "peft.target_modules: ['down_proj'] on gpt_oss"),
        (gpt_oss, replace(lora, modules_to_save=["gate"]), "peft.modules_to_save: gate is not a module of this gpt_oss"),
    ]:
        with pytest.raises(UnsupportedConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            check_model(model, cfg)
    check_model(mixtral, replace(lora, method="dora", target_modules=["q_proj", "v_proj"]))  # attention only
    check_model(qwen2, replace(lora, method="dora", target_modules=["q_proj", "v_proj"]))
    check_model(qwen2, replace(shared, modules_to_save=["gate"]))
