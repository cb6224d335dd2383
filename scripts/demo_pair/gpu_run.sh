#!/usr/bin/env bash
# Train and evaluate the demo draft/target pair on the GPU machine, then pack what must
# come back into one output directory within a remote GPU machine's transfer limits (at most 8 files of
# at most 16 MiB each, at most 2 folders deep): the safetensors shards (each <= 15 MiB) as
# OUT/target/*.safetensors and OUT/draft/*.safetensors, every other file (configs,
# tokenizer, model cards, training summaries, logs) in OUT/demo_pair_files.tar.gz, and the
# console log as OUT/run.log.
#
#   bash scripts/demo_pair/gpu_run.sh "$OUT"                 # from the repository root
#   bash scripts/demo_pair/gpu_run.sh "$OUT" --seed 1        # extra args go to python -m demo_pair
set -euo pipefail
out_dir="${1:?usage: gpu_run.sh OUT_DIR [python -m demo_pair options]}"
shift
work="${WORK:-/tmp/demo_pair}"
python="${PYTHON:-python3}"
rm -rf "$work"
mkdir -p "$work/logs" "$out_dir"
export PYTHONPATH=src:scripts PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c 'import sys, torch, tokenizers; print(sys.version); print("torch", torch.__version__, "tokenizers", tokenizers.__version__)'
  start=$(date +%s)
  "$python" -m demo_pair --out "$work/models" --log-dir "$work/logs" "$@"
  echo "wall time of python -m demo_pair: $(( $(date +%s) - start )) s"
} 2>&1 | tee "$out_dir/run.log"   # in OUT at once: it comes back even if a step fails
for role in target draft; do
  mkdir -p "$out_dir/$role"
  cp "$work/models/$role/"*.safetensors "$out_dir/$role/"
done
tar -C "$work" --exclude='*.safetensors' -czf "$out_dir/demo_pair_files.tar.gz" models logs
ls -lR "$out_dir"
