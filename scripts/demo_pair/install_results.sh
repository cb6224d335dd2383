#!/usr/bin/env bash
# Put what gpu_run.sh packed (OUT/target/*.safetensors, OUT/draft/*.safetensors,
# OUT/demo_pair_files.tar.gz, OUT/run.log) into src/infer/demo_models/{target,draft} and
# the logs into runs/demo_pair/, then check the result with python -m demo_pair.verify.
#
#   bash scripts/demo_pair/install_results.sh /path/to/fetched/out     # from the repo root
set -euo pipefail
src="${1:?usage: install_results.sh FETCHED_OUT_DIR}"
dest="${DEST:-src/infer/demo_models}"
logs="${LOGS:-runs/demo_pair}"
python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$src/demo_pair_files.tar.gz" -C "$tmp"
for role in target draft; do
  rm -rf "${dest:?}/$role"
  mkdir -p "$dest/$role"
  cp "$tmp/models/$role/"* "$dest/$role/"
  cp "$src/$role/"*.safetensors "$dest/$role/"
  chmod 644 "$dest/$role/"*
done
mkdir -p "$logs"
cp "$tmp/logs/"* "$src/run.log" "$logs/"
PYTHONPATH=src:scripts "$python" -m demo_pair.verify "$dest/target" "$dest/draft"
