#!/usr/bin/env bash
# Download the peer bench's wheels (tools/bench_peers.py) into .whl/ on a machine that reaches PyPI, for a GPU
# machine that reaches no index: carry .whl/ there and `bash tools/gpu_checklist.sh 4` installs them into a scratch
# --target folder. Never dependencies of hfmeg. PYVER is the GPU machine's Python (default 3.12); the GPU image
# already has torch, triton, transformers, safetensors and typing_extensions, so only these are fetched:
#   torchtitan 0.3.0 and what its model/parallelize/FSDP2 path imports (spmd_types, tyro and its two, einops,
#   torchdata, torch_checkpointing); megatron-core 0.19.2 (its wheel is compiled: one per Python version).
set -eu
PY=${PY:-python3}
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 einops==0.8.2 \
  torchdata==0.11.0 torch_checkpointing==0.1.1 megatron-core==0.19.2
ls -1 "$DEST"
