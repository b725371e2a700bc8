"""Build hook: a wheel carries copies of `configs/` and `artifacts/` as package data.

Everything else is in pyproject.toml. The repository keeps both folders at its
root, where the README, docs and manifests name them; `build_py` copies them into
the wheel's `jaxkv/_shipped/` (byte for byte), where `jaxkv.shipped` finds them
once installed. An editable install copies nothing: it reads the clone.
"""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
SHIPPED = {"configs": "*.py", "artifacts": "**/*"}   # folder -> the files copied


class BuildPyWithShipped(build_py):
  """`build_py`, then the shipped folders into <build>/jaxkv/_shipped/."""

  def run(self):
    super().run()
    if getattr(self, "editable_mode", False):
      return
    for folder, pattern in SHIPPED.items():
      for src in sorted((ROOT / folder).glob(pattern)):
        if src.is_file() and "__pycache__" not in src.parts:
          dst = pathlib.Path(self.build_lib, "jaxkv", "_shipped", src.relative_to(ROOT))
          dst.parent.mkdir(parents=True, exist_ok=True)
          shutil.copyfile(src, dst)


setup(cmdclass={"build_py": BuildPyWithShipped})
