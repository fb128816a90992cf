#!/usr/bin/env bash
# The GPU checklist (../shared/gpu-checklist.md) in three parts of under ten minutes each, for a
# lent single-GPU machine that already has a CUDA build of torch:
#
#   bash tools/gpu_checklist.sh 1   # suite on CUDA (+ the CPU suite beside it), attention, calibration,
#                                   # the trainer end to end on NCCL (bf16, resume, fp16, export)
#   bash tools/gpu_checklist.sh 2   # MFU: plain, on the trainer path, vs a compiled transformers,
#                                   # and 13B layer shapes under each recompute mode
#   bash tools/gpu_checklist.sh 3   # a Mixtral (8 experts, top-2) vs transformers, with and without full
#                                   # recompute, and the planner against those runs
#   bash tools/gpu_checklist.sh 4   # peers side by side (tools/bench_peers.py): hfmeg, transformers (eager and
#                                   # compiled), torchtitan, Megatron-Core on 4 LLaMA-7B layers and a 1-layer
#                                   # Mixtral; JSON lines into docs/measurements/ (wheels: tools/peer_wheels.sh)
#   bash tools/gpu_checklist.sh 5   # what is new since the last GPU: every GPU-marked test (each newer family's
#                                   # bf16 parity, windowed + soft-capped flex in one graph), tokens/s of five
#                                   # families against transformers, DPO against TRL's DPOTrainer
#
# Logs and JSON go to $OUT (default out/gpu). Wheels in .whl/ (missing packages, carried to the
# machine) are installed into /tmp/site first; the assets are looked for in .gpu/assets when
# ../shared/assets is absent. Every step has its own time limit so that a hang costs one step,
# not the part. LAYERS (default 16) sets the 7B-shape layers of the MFU runs.
set -u
part=${1:?usage: gpu_checklist.sh 1|2|3|4|5}
OUT=${OUT:-out/gpu}
PY=${PY:-python3}
LAYERS=${LAYERS:-16}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ! -d ../shared/assets ] && [ -d .gpu/assets ]; then
  mkdir -p ../shared && ln -sfn "$PWD/.gpu/assets" ../shared/assets
fi
STORIES=../shared/assets/models/stories260K
ALPACA=../shared/assets/data/alpaca_en_demo.json

step() {  # step NAME SECONDS CMD...: one logged, time-limited step
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0))s"
}

part1() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, transformers, datasets, pyarrow; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
  step "suite: test_gpu" 180 "$PY" -m pytest -q -rs tests/test_gpu.py
  # The CPU suite beside the GPU steps (16 cores, 8 xdist workers): it must stay on CPU/gloo on a GPU machine.
  (timeout 420 "$PY" -m pytest -q -n 8 -p no:cacheprovider --ignore=tests/test_gpu.py tests >"$OUT/pytest_cpu.log" 2>&1;
   echo "exit $?" >>"$OUT/pytest_cpu.log") &
  local suite=$!
  step "attention bench" 120 "$PY" tools/bench_attention.py
  step "planner calibration" 150 "$PY" -m hfmeg.plan calibrate --device cuda --out "$OUT/gpu_profile.json"
  trainer
  wait "$suite"
  tail -5 "$OUT/pytest_cpu.log"
}

trainer() {
  local run="torchrun --standalone --nproc_per_node 1 recipes/sft_llama13b.py --model $STORIES --data $ALPACA
    --tp 1 --seq-len 512 --global-batch-size 16 --lr 3e-3 --warmup-steps 5 --eval-every 0"
  rm -rf out/gpu-r1 out/gpu-fp16
  step "trainer bf16 20 steps" 120 $run --max-steps 20 --save-every 10 --out out/gpu-r1
  step "trainer resume to 30" 120 $run --max-steps 30 --save-every 10 --out out/gpu-r1 --resume auto
  step "trainer fp16 10 steps" 120 $run --max-steps 10 --dtype fp16 --out out/gpu-fp16
  cp out/gpu-r1/metrics.jsonl "$OUT/trainer_metrics.jsonl" 2>/dev/null
  step "export loads and generates" 60 "$PY" - <<'EOF'
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
for run in ("out/gpu-r1/hf", "out/gpu-fp16/hf"):
    tok = AutoTokenizer.from_pretrained(run)
    model = AutoModelForCausalLM.from_pretrained(run).to("cuda")
    ids = tok("Once upon a time", return_tensors="pt").to("cuda")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    print(run, model.dtype, repr(tok.decode(out[0], skip_special_tokens=True)))
EOF
}

part2() {
  step "MFU, $LAYERS 7B layers" 200 "$PY" tools/bench_mfu.py --layers "$LAYERS"
  step "MFU, $LAYERS 7B layers, trainer path" 200 "$PY" tools/bench_mfu.py --layers "$LAYERS" --trainer-path
  step "MFU, $LAYERS 7B layers, vs compiled transformers" 240 "$PY" tools/bench_mfu.py --layers "$LAYERS" --hf-compile
  for r in none selective full; do
    step "13B layer shapes, 4 layers, recompute $r" 100 "$PY" tools/bench_mfu.py --layers 4 --hidden 5120 \
      --ffn 13824 --heads 40 --recompute "$r" --steps 3 --warmup 2
  done
}

part3() {
  local moe="--layers 2 --ffn 14336 --experts 8 --top-k 2"
  step "Mixtral 2 layers" 170 "$PY" tools/bench_mfu.py $moe | tee "$OUT/moe.jsonl"
  step "Mixtral 2 layers, full recompute" 170 "$PY" tools/bench_mfu.py $moe --recompute full | tee -a "$OUT/moe.jsonl"
  step "calibration" 150 "$PY" -m hfmeg.plan calibrate --device cuda --out "$OUT/gpu_profile.json"
  local kind  # the planner's own name for this GPU (hardware.gpu_kind)
  kind=$("$PY" -c "import torch; from hfmeg.plan.hardware import gpu_kind
p = torch.cuda.get_device_properties(0); print(gpu_kind(p.name, p.total_memory))")
  "$PY" tools/check_plan_gpu.py "$OUT/moe.jsonl" --profile "$OUT/gpu_profile.json" --gpu "$kind"
}

part4() {
  "$PY" -c "import importlib.metadata as m
for d in ('torch', 'transformers', 'torchtitan', 'megatron-core', 'transformer-engine', 'apex'):
    try: print(d, m.version(d))
    except m.PackageNotFoundError: print(d, 'not installed')"
  # Only the JSON lines are kept (the table and skip lines are in the log); a peer that is absent stays a skipped row.
  step "peers, 4 LLaMA-7B layers, 3 rounds" 330 "$PY" tools/bench_peers.py --layers 4 --steps 4 --warmup 2 \
    | tee "$OUT/peers.log" | grep '^{' >docs/measurements/gpu_bench_peers.jsonl
  step "peers, 1 Mixtral layer (8 experts, top-2), 3 rounds" 240 "$PY" tools/bench_peers.py --layers 1 --ffn 14336 \
    --experts 8 --top-k 2 --steps 3 --warmup 2 --systems hfmeg,transformers,torchtitan,megatron-core \
    | tee "$OUT/peers_moe.log" | grep '^{' >docs/measurements/gpu_bench_peers_moe.jsonl
  cat "$OUT/peers.log" "$OUT/peers_moe.log" | grep -v '^{'
}

part5() {
  step "GPU-marked tests" 240 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu.py \
    tests/test_attention.py tests/test_staging.py tests/test_linear_cross_entropy.py
  # Small shapes (4 layers of 1024, 16 heads, seq 2048, packed rows as the trainer feeds them): the family's own
  # layers against transformers' (eager where it has no SDPA path or caps scores); windows shorter than the row.
  local small="--layers 4 --hidden 1024 --ffn 2816 --heads 16 --vocab 32000 --seq 2048 --micro-batch-size 2
    --grad-accum 1 --steps 3 --warmup 2 --trainer-path"
  for family in "qwen3" "gemma2 --set sliding_window=512" "gpt_oss --set num_local_experts=8 --set sliding_window=512" \
      "deepseek_v3 --set n_routed_experts=8 --set n_group=1 --set topk_group=1 --set first_k_dense_replace=1"; do
    step "tokens/s, $family" 90 "$PY" tools/bench_mfu.py $small --family $family | tee -a "$OUT/families.log"
  done
  # transformers' Qwen3.5 runs its PyTorch fallback of the gated delta rule where flash-linear-attention is absent
  step "tokens/s, qwen3_5_text" 120 "$PY" tools/bench_mfu.py ${small/--seq 2048/--seq 1024} --steps 2 --warmup 1 \
    --family qwen3_5_text | tee -a "$OUT/families.log"
  grep '^{' "$OUT/families.log" >"$OUT/families.jsonl"
  # hfmeg's first DPO step took 66 s at hidden 1024 on an H200 (not profiled): small shapes, time for TRL's too
  step "DPO vs TRL" 240 "$PY" tools/bench_dpo.py --hidden 512 --layers 4 --seq 512 --rows 4 --trl-batch 2 \
    --pairs 64 --steps 3 --warmup 1
}

"part$part" 2>&1 | tee "$OUT/part$part.log"
