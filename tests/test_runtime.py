"""jaxkv.runtime: no libtpu line on a machine without a TPU, and the persistent
compilation cache and progress lines `jaxkv.load` gives the Python API."""

import logging
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxkv import runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]
_INFO = "import logging; logging.basicConfig(level=logging.INFO)\n"   # as absl's handler shows


def _python(code, tmp_path, **env):
  """`code` in a fresh interpreter, JAX picking its backend as a user's run does
  (conftest's JAX_PLATFORMS=cpu left out)."""
  base = {k: v for k, v in os.environ.items()
          if k not in ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=600, cwd=tmp_path, env={**base, **env})


def test_import_jaxkv_prints_no_libtpu_line(tmp_path):
  probe = "import jax; print(jax.devices())\n"
  bare = _python(_INFO + probe, tmp_path)
  if "libtpu" not in bare.stderr:
    pytest.skip("JAX logs no TPU probe here (a TPU runtime is installed, or JAX changed)")
  p = _python(_INFO + "import jaxkv\n" + probe, tmp_path)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "libtpu" not in p.stderr and "Unable to initialize backend 'tpu'" not in p.stderr


def test_tpu_probe_filter_drops_only_that_line():
  f = runtime._NoTpuProbe()

  def rec(msg):
    return logging.LogRecord("jax._src.xla_bridge", logging.INFO, __file__, 1, msg, None, None)

  assert not f.filter(rec("Unable to initialize backend 'tpu': INTERNAL: Failed to open "
                          "libtpu.so: libtpu.so: cannot open shared object file"))
  assert f.filter(rec("Unable to initialize backend 'cuda': no CUDA devices"))
  assert f.filter(rec("Unable to initialize backend 'tpu': TPU initialization failed: busy"))
  runtime.quiet_tpu_probe()
  runtime.quiet_tpu_probe()
  assert sum(isinstance(x, runtime._NoTpuProbe)
             for x in logging.getLogger("jax._src.xla_bridge").filters) == 1


def test_compilation_cache_keeps_a_directory_already_set(tmp_path, monkeypatch):
  before = jax.config.jax_compilation_cache_dir
  monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "home"))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert runtime.compilation_cache(False) is None                 # off: nothing turned on
    assert jax.config.jax_compilation_cache_dir is None
    assert runtime.compilation_cache() == str(tmp_path / "home/xla")   # the default
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert runtime.compilation_cache() == str(tmp_path / "mine")     # the user's, kept
    assert runtime.compilation_cache(str(tmp_path / "x")) == str(tmp_path / "x")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.slow
def test_load_turns_on_the_cache_and_reports_progress(tmp_path):
  """`jaxkv.load` as a user calls it: the shared persistent cache (what the CLI
  uses) is on and filled, and stderr says what the first minute is spent on;
  `verbose=False` prints nothing."""
  code = ("import sys, jax, jaxkv\n"
          "llm = jaxkv.load('smollm2-135m')\n"
          "llm.generate('The sky is', jaxkv.SamplingConfig(max_tokens=1))\n"
          "llm.generate('The sky is', jaxkv.SamplingConfig(max_tokens=1))\n"
          "print(jax.config.jax_compilation_cache_dir)\n"
          "print('-- quiet --', file=sys.stderr, flush=True)\n"
          "quiet = jaxkv.load('smollm2-135m', verbose=False, compilation_cache=False)\n"
          "quiet.generate('Hi', jaxkv.SamplingConfig(max_tokens=1))\n")
  p = _python(code, tmp_path, JAXKV_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  assert p.returncode == 0, p.stderr[-3000:]
  loud, quiet = p.stderr.split("-- quiet --\n")
  lines = loud.splitlines()
  assert lines[0] == "loading smollm2-135m weights..."
  assert lines[1].startswith("loaded smollm2-135m (llama, 30 layers) in ")
  assert lines[2].startswith("compiling the model's steps on first use")
  assert len(lines) == 3 and quiet == "", p.stderr          # said once; verbose=False: silent
  xla = tmp_path / "cache/xla"
  assert p.stdout.split() == [str(xla)] and any(xla.iterdir())
