#!/usr/bin/env bash
# The GPU lane: NCCL parity of DP, TP, PP and 3D, bf16-mixed, and peak memory against the estimate.
# Run from anywhere on a node with CUDA GPUs:  bash scripts/gpu_check.sh  (extra arguments go to pytest).
# Tests needing more GPUs than are visible are skipped with the count they need (3D needs 8).
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
detail = f" ({torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})" if n else ""
print(f"CUDA GPUs visible: {n}{detail}")
PY
exec python -m pytest -q -rs -m cuda tests/test_cuda.py "$@"
