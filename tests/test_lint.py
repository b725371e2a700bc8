"""`ruff check` over the repository is clean (the rules: pyproject.toml's [tool.ruff.lint]).

ruff comes with the test extra (scripts/setup.sh installs it); a missing ruff fails
here rather than skipping, so CI cannot pass without the lint."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
  cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise", "."]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"
