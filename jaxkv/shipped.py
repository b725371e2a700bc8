"""Where the shipped `configs/` and `artifacts/` are: a clone's root, or inside the
installed package.

    shipped.root()                      # /path/to/clone, or .../site-packages/jaxkv/_shipped
    shipped.resolve("artifacts/smollm2-135m/pruner_head")
    shipped.config_file("smollm2")      # -> .../configs/smollm2.py

Decision. The repository keeps `configs/` and `artifacts/` at its root, where the
README, the docs and the artifacts' manifests name them (`configs/smollm2.py`,
`artifacts/smollm2-135m/pruner_head`) and where `python scripts/serve.py
--config=configs/<name>.py` finds them from a clone. They are not moved into the
package: a wheel gets copies instead. `setup.py`'s build step copies them into
`jaxkv/_shipped/configs/` and `jaxkv/_shipped/artifacts/` of the wheel (byte for
byte, so the manifests' sha256 still hold); an editable install (`pip install
-e .`, what scripts/setup.sh does) copies nothing and reads the clone. So the
root is `jaxkv/_shipped/` when that folder exists (an installed wheel), else the
repository root (a clone).

A relative path is looked up in the working directory first, then under the
root: the defaults (`PruningConfig.head_path`, the role adapters) and
`--config=configs/smollm2.py` work from any directory, installed or not, and a
file of the user's own with the same relative path wins. `--config` also takes a
shipped config's bare name (`--config=smollm2`).
"""

from __future__ import annotations

import os
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent
REPO = PACKAGE.parent           # the clone's root (an editable install points here)
WHEEL = PACKAGE / "_shipped"    # an installed wheel's copies (setup.py puts them there)
SHIPPED = ("configs", "artifacts")


def root() -> pathlib.Path:
  """The folder holding `configs/` and `artifacts/`."""
  return WHEEL if WHEEL.is_dir() else REPO


def resolve(path: str | os.PathLike) -> pathlib.Path:
  """`path` as given if it exists (or is absolute), else under `root()` when it is
  there, else as given (so an error names the path the user wrote)."""
  p = pathlib.Path(path)
  if p.exists() or p.is_absolute() or not (root() / p).exists():
    return p
  return root() / p


def config_names() -> list[str]:
  """The shipped configs' names (`configs/<name>.py`)."""
  return sorted(p.stem for p in (root() / "configs").glob("*.py"))


def config_file(spec: str) -> str | None:
  """The config file a `--config` value names, or None: the path as given when it
  is a file, else a shipped config: `configs/<name>.py`, `<name>.py` or `<name>`."""
  p = pathlib.Path(spec)
  if p.is_file():
    return spec
  if p.is_absolute() or str(p.parent) not in (".", "configs"):
    return None
  f = root() / "configs" / (p.name if p.suffix == ".py" else f"{p.name}.py")
  return str(f) if f.is_file() else None
