#!/usr/bin/env bash
# Every wheel a GPU loan needs (docs/gpu.md) into .whl/ (git-ignored), on a machine that reaches PyPI, for a GPU
# machine that reaches no index; then check that what a device call carries stays under its 64 MiB.
#
# The GPU image (Python 3.12, torch 2.11 + CUDA 13, triton, transformers 5.17, peft, accelerate, einops, safetensors,
# pandas, pyarrow, fsspec, xxhash, typing_extensions; no datasets) lacks these, fetched without their dependencies:
#   - torchtitan 0.3.0 (its Llama 3 / Qwen3 model, parallelize, loss and optimizer; on torch 2.11 through
#     tools/peer_shims.py) and what that path imports: spmd_types, tyro (+ docstring-parser, typeguard), torchdata,
#     torch_checkpointing;
#   - megatron-core 0.19.2 (a compiled wheel: one per Python version, PYVER);
#   - torchao 0.17.0 (built against torch 2.11, the first it loads its kernels for);
#   - for `gpu_loan.py --features`' DPO check: trl 1.16.0, datasets 5.2.0 (+ dill, multiprocess), as in the venv;
#   - transformers 5.24.0 and peft 0.21.2, the versions the suite is tested with (the image has transformers 5.17,
#     older than some families' code; its huggingface_hub, tokenizers and safetensors satisfy 5.24).
# Never dependencies of hfmeg. Then the size check: the files a call sends (tracked and untracked-not-ignored, as
# `git ls-files` lists them) plus the carried folders (CARRY, default ".whl .loan .gpu") must stay under 64 MiB.
set -eu
PY=${PY:-python3}
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
CARRY=${CARRY:-.whl .loan .gpu}
LIMIT=$((64 * 1024 * 1024))
WHEELS=(torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0
        torch_checkpointing==0.1.1 megatron-core==0.19.2 torchao==0.17.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1
        multiprocess==0.70.19 transformers==5.24.0 peft==0.21.2)
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
# One version of each: an older download left in the folder would stop the whole install on the device.
"$PY" - "$DEST" "${WHEELS[@]}" <<'EOF'
import re, sys
from pathlib import Path
dest, pins = Path(sys.argv[1]), sys.argv[2:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
want = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
for whl in sorted(dest.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if want.get(norm(name)) != version:
        print(f"peer_wheels: removing {whl.name} (not pinned here)")
        whl.unlink()
EOF
ls -1 "$DEST"
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carried=0
for path in $CARRY; do
  [ -e "$path" ] && carried=$((carried + $(du -sb "$path" | cut -f1)))
done
total=$((tree + carried))
printf 'peer_wheels: tree %.1f MiB + carried (%s) %.1f MiB = %.1f MiB of 64 MiB\n' \
  "$(echo "$tree / 1048576" | bc -l)" "$CARRY" "$(echo "$carried / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -ge "$LIMIT" ]; then
  echo "peer_wheels: over the 64 MiB a device call carries: carry less (CARRY=...)" >&2
  exit 1
fi
