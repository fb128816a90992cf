"""The planner's count of a preference run's reference model (`hfmeg plan --loss-type`, `--layout auto`).

Memory: full fine-tuning's frozen reference copy is the bytes the trainer's own reference (`FullModel.reference`)
allocates on each rank, to the byte, at TP2 and PP2; LoRA's reference is the base itself and adds nothing.
Time: the live reference's forward-only pass is added to the step, once per micro-batch, at the size of a forward.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_ps
from tiny_models import save_tiny

from hfmeg.families import model_config_from_hf
from hfmeg.config import load_hf_config
from hfmeg.parallel.launch import spawn
from hfmeg.plan.hardware import ClusterSpec, gpu_spec
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.profile import default_profile
from hfmeg.plan.step_time import step_time
from hfmeg.train.config import ModelArgs, TrainConfig
from hfmeg.train.parts.full import FullModel
from hfmeg.train.preference import PreferenceConfig


def _reference_bytes(folder: str, tp: int, pp: int) -> int:
    ps = make_ps(tp=tp, pp=pp)
    cfg = TrainConfig(model=ModelArgs(path=folder, dtype="fp32"))
    part = FullModel(cfg, ps, torch.float32)
    chunks, _ = part.build(None, 0)
    frozen = part.reference(chunks).chunks
    assert not any(p.requires_grad for c in frozen for p in c.parameters())
    return sum(p.numel() * p.element_size() for c in frozen for p in c.parameters())


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_reference_copy_is_what_the_trainer_allocates(tp, pp, tmp_path):
    folder = save_tiny("llama3", tmp_path / "base")
    allocated = spawn(_reference_bytes, 2, str(folder), tp, pp)
    cfg = model_config_from_hf(load_hf_config(folder))
    lay = PlanLayout(tp, pp, 1, 1, 1, "none", False, "overlapped", "1f1b", 1, 1)
    for rank, got in enumerate(allocated):
        r = rank // tp  # the pipeline stage of this rank
        plain = stage_memory(cfg, lay, r, 2, 32, dtype_bytes=4)
        counted = stage_memory(cfg, lay, r, 2, 32, dtype_bytes=4, reference_copy=True)
        assert counted.frozen_weights - plain.frozen_weights == got, (rank, counted, plain)
        assert counted.total - plain.total == got


def test_live_reference_adds_a_forward_per_microbatch(tmp_path):
    cfg = model_config_from_hf(load_hf_config(save_tiny("llama3", tmp_path / "base")))
    spec = gpu_spec("h100")
    cluster, prof = ClusterSpec(spec, 8, 8), default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    lay = PlanLayout(2, 2, 2, 1, 1, "none", True, "overlapped", "1f1b", 1, 1)
    plain = step_time(cfg, lay, cluster, prof, 16, 128)
    live = step_time(cfg, lay, cluster, prof, 16, 128, reference_forward=True)
    assert plain.reference_s == 0 and live.reference_s > 0
    assert live.step_s - live.reference_s == pytest.approx(plain.step_s, rel=1e-12)
    # a forward is about a third of forward + backward (no recompute): the reference's share of the compute
    assert 0.25 < live.reference_s / (live.compute_s + live.bubble_s) < 0.5


@pytest.mark.parametrize("peft, copy", [(False, True), (True, False)])
def test_the_trainer_asks_for_what_its_reference_holds(peft, copy):
    assert PreferenceConfig(loss_type="sigmoid").planner_terms(adapters=peft) == dict(reference_forward=True,
                                                                                      reference_copy=copy)
    assert PreferenceConfig(loss_type="sigmoid", reference="precomputed").planner_terms(adapters=peft) == dict(
        reference_forward=False, reference_copy=False)
    assert PreferenceConfig(loss_type="simpo").planner_terms(adapters=peft) == dict(reference_forward=False,
                                                                                    reference_copy=False)
