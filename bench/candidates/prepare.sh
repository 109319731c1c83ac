#!/usr/bin/env bash
# Make alt/<name>/packages/kda-cute/kda_cute for every candidate patch here (this checkout's HEAD
# with the patch applied), for `bash bench/gpu_suite.sh candidates` or bench/cpu_emulate.py.
# Run here, before the device call: alt/ is untracked and travels with the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf alt
for p in bench/candidates/*.patch; do
  [ -e "$p" ] || { echo "no candidate patches in bench/candidates"; break; }
  n=$(basename "$p" .patch)
  mkdir -p "alt/$n"
  git archive HEAD packages/kda-cute/kda_cute | tar -x -C "alt/$n"
  patch -s -p1 -d "alt/$n" < "$p"
  echo "alt/$n"
done
