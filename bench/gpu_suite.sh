#!/usr/bin/env bash
# The GPU suite: everything that needs the H200, in one device call. Logs and results go under
# $OUT (at most 8 files come back: suite.log, bench.json, chain_errors.json, triton-autotune.tar,
# triton-cache.tar.xz with savecache). Each step has its own time limit, so one slow step cannot eat the call.
#
#   bash bench/gpu_suite.sh [steps]   steps: witness witness_keep varlen intra scans stages launch tvmffi train soak shared tests fp16 bench peer ncu save savecache
#                                     (default: all but fp16, ncu, savecache)
#
# On a 2-GPU machine two lanes run side by side, each with its own OUT and GPU, `save` once last:
#   (CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a bash bench/gpu_suite.sh scans bench) &
#   (CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b bash bench/gpu_suite.sh tests witness) &
#   wait; bash bench/gpu_suite.sh save
#
# On the device machine, after the devkit (../shared/device/README.md):
#   source .dev-b/setup.sh || exit $?; bash bench/gpu_suite.sh          (carry .dev-b and .devcache)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/packages/kda-cute:$PWD/chain:$PWD/witness:$PWD/tools/ptxsim:$PWD/bench:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda-suite}
mkdir -p "$OUT"
LOG=$OUT/suite.log
steps=${*:-witness intra scans launch tests bench save}

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== $name: $*" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

# fla's Triton kernels compile on every fresh machine (over a minute; the devkit restores only
# their autotune choices). A cache saved by an earlier run, carried as .devcache/, skips that.
if [ -n "${TRITON_CACHE_DIR:-}" ] && [ -f .devcache/triton-cache.tar.xz ] \
   && mkdir "$TRITON_CACHE_DIR/.kda-restore" 2>/dev/null; then  # once per machine, also with two lanes
  tar -xJf .devcache/triton-cache.tar.xz -C "$TRITON_CACHE_DIR" && echo "restored the Triton cache" | tee -a "$LOG"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
# the cuDNN-frontend peer (bench/test_chain.py), when the kit's .dev-p travelled with the call
if ls .dev-p/*.whl >/dev/null 2>&1 && [ ! -d /tmp/kda-peer ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kda-peer .dev-p/*.whl && echo "installed the cuDNN peer" | tee -a "$LOG"
fi
[ -d /tmp/kda-peer ] && export PYTHONPATH=$PYTHONPATH:/tmp/kda-peer
for s in $steps; do
  case $s in
    witness)
      step witness 150 python -m kda_chain.witness --reps 5
      python -m kda_chain.witness --require-cute --reps 1 --B 2 --T 1024 >>"$LOG" 2>&1
      echo "=== witness --require-cute (B2 T1024) rc=$?" | tee -a "$LOG"
      ;;
    witness_keep)  # disable_recompute=True: the forward keeps w, u, qg, kg, h, v_new for the backward
      step witness_keep 150 python -m kda_chain.witness --reps 5 --disable-recompute ;;
    varlen)  # packed sequences: the GPU tests (vs fla and float64), then the speed (bench/varlen.py)
      step varlen_bench ${VARLEN_BENCH_LIMIT:-300} python bench/varlen.py --json "$OUT/varlen.json" ${VARLEN_ARGS:-}
      step varlen_tests ${VARLEN_LIMIT:-300} python -m pytest -p no:cacheprovider -v --timeout=280 tests/gpu/test_varlen_gpu.py \
        -k "${VARLEN_K:-varlen}" ;;
    intra)
      step check_intra 200 python bench/check_intra.py ;;
    scans)  # one process per scan: a hang costs only its own limit
      for st in ${SCAN_STAGES:-b1 fwd dhu}; do step "check_scans_$st" ${SCAN_LIMIT:-150} python bench/check_scans.py --stage $st; done ;;
    stages)  # the chunk-parallel CuTe stages vs fla on a chain call's arguments (bench/check_stage.py)
      step check_stages ${STAGE_LIMIT:-400} python bench/check_stage.py --stage ${CHECK_STAGES:-fwd_prep bwd_prep bwd_chunk} \
        ${CHECK_ALT:+--alt $CHECK_ALT} ;;  # CHECK_ALT: a package copy timed beside ours (--alt)
    launch)  # host vs device time per launch and per chain step (the small-shape slowdown)
      step check_launch 120 python bench/check_launch.py
      step check_launch_profile 150 python bench/check_launch.py --profile --pstats "$OUT" ;;
    tvmffi)  # one CuTe launch's host cost: the call cache against the DSL's TVM-FFI path
      step check_tvm_ffi 150 python bench/check_tvm_ffi.py ;;
    train)  # the 2-layer KDA LM's train step, ours vs fla (eager; TRAIN_ARGS=--compile for compiled)
      step train_step ${TRAIN_LIMIT:-200} python bench/train_step.py ${TRAIN_ARGS:-} ;;
    soak)  # SOAK_CALLS fwd+bwd with changing shapes: memory flat, results repeatable (soak.png)
      step soak ${SOAK_LIMIT:-300} python bench/soak.py --calls ${SOAK_CALLS:-1000} --out "$OUT" ;;
    tests)  # pytest-timeout (on the GPU image) dumps every thread's stack if a test hangs. The
            # fp16 chain test is its own step: fla autotunes fp16 from scratch (minutes, not seeded)
      step gpu_tests ${TESTS_LIMIT:-300} python -m pytest -p no:cacheprovider -p kda_witness.pytest_plugin -v --durations=15 --timeout=${TEST_TIMEOUT:-150} tests/gpu -k "${TESTS_K:-not gva_fp16}" ;;
    fp16)  # then `save`, so fla's fp16 autotune results come back in triton-autotune.tar
      step gpu_tests_fp16 ${FP16_LIMIT:-450} python -m pytest -p no:cacheprovider -v --timeout=420 tests/gpu -k gva_fp16 ;;
    bench)
      step bench ${BENCH_LIMIT:-300} python -m pytest -p no:cacheprovider -q bench --benchmark-json="$OUT/bench.json" \
        --benchmark-columns=median,iqr,rounds --bench-shapes ${BENCH_SHAPES:-ref,small} ;;
    shared)  # two processes on one GPU at once (cold compiles, opposite shape orders) vs one alone
      step shared_gpu ${SHARED_LIMIT:-240} python bench/shared_gpu.py --out "$OUT/shared" ;;
    peer)  # ours, fla, cuDNN (when .dev-p travelled) and attn-gym side by side on the peers' inputs
           # (PEER_K: a pytest -k expression over the shapes, e.g. "peer_small or peer_b2")
      step peer ${PEER_LIMIT:-400} python -m pytest -p no:cacheprovider -q bench/test_chain.py -k "vs_peer ${PEER_K:+and ($PEER_K)}" \
        --benchmark-json="$OUT/peer.json" --benchmark-columns=median,iqr,rounds ;;
    ncu)  # Nsight Compute: NCU_STAGE's CuTe kernel (default b1 without a state): the details page
          # and the per-instruction SASS table (stall samples) come back. NCU_FLA=1 adds fla's
          # kernel (NCU_K must then match it): fla autotunes under ncu unless its choices for that
          # exact key are restored (2026-12-01: 85 profiled launches, over the 300 s limit)
      step ncu ${NCU_LIMIT:-300} ncu --clock-control none -k "regex:${NCU_K:-kda_cute_b1}" \
        --set full -f -o "$OUT/prof" python bench/ncu_profile.py --stage "${NCU_STAGE:-b1}" \
        ${NCU_FLA:+--fla} --no-h0
      ncu -i "$OUT/prof.ncu-rep" --page details >"$OUT/ncu_details.txt" 2>&1
      ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_sass.csv" 2>&1
      xz -f -T0 "$OUT/ncu_sass.csv"  # 46 MB with fla's in it: over what comes back
      rm -f "$OUT/prof.ncu-rep"  # ~20 MB: over what comes back
      ls -la "$OUT"/ncu_* | tee -a "$LOG" ;;
    save)  # fla's autotune choices and compiled kernels: copy them to .dev-b/ and .devcache/ here
      # (setup.sh's kda_save_autotune is a shell function: not visible in this script's shell,
      # which is how the 2026-12-01 fp16 run lost its autotune results; the same, inline)
      if [ -n "${TRITON_CACHE_DIR:-}" ]; then
        (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 \
           | tar --null -cf "$OUT/triton-autotune.tar" -T -) && ls -la "$OUT/triton-autotune.tar" | tee -a "$LOG"
      fi ;;
    savecache)  # fla's compiled kernels too (single-threaded xz -9 of the whole cache took minutes
      # on 2026-12-01 and came back empty, over the 16 MB a file may; now xz -3 on every core).
      # Only worth it on a cache that has not grown past that.
      if [ -n "${TRITON_CACHE_DIR:-}" ]; then
        # without fla's autotune choices: those come from .dev-b (tuned at the reference shape).
        # fla's autotune key has no B or T, so a choice made at whatever shape a run met first
        # would follow the cache into every later timing (2026-12-01: fla's fwd_h 1.89-1.92 ms
        # at the reference shape after such a cache, 1.84 with the seeded choices)
        timeout 90 tar -C "$TRITON_CACHE_DIR" --exclude='*.autotune.json' -cf - . 2>/dev/null \
          | xz -T0 -3 >"$OUT/triton-cache.tar.xz"
        [ "$(stat -c %s "$OUT/triton-cache.tar.xz" 2>/dev/null || echo 0)" -lt 16000000 ] || rm -f "$OUT/triton-cache.tar.xz"
      fi ;;
  esac
done
grep -E "^=== " "$LOG"
