"""The package a user installs: the wheel built from this tree, installed into a
fresh virtual environment offline, gives the console commands, its own configs
and shipped artifacts, and runs the default job from a directory outside the
repository.

The new environment has no pip and no dependencies of its own: this test's
interpreter installs the jaxkv wheel into it (`pip --python`, `--no-deps
--no-index`) and a `.pth` file lends it this environment's site-packages for the
dependencies (a `.pth` line adds a folder to sys.path; the editable jaxkv's own
`.pth` hook there is not run, and the new site-packages comes first). So nothing
is downloaded, and `jaxkv` itself can only come from the wheel, which the test
checks (`jaxkv.__file__`, the artifact paths, the command's module).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md",
           "jaxkv", "pallas_kernels", "configs", "artifacts")


def _run(cmd, **kw):
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
  assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-3000:])
  return p


def _copy_sources(dst: pathlib.Path) -> None:
  """The files git would check out (tracked or new, not ignored) of SOURCES: the
  wheel is built from a copy, so the build leaves nothing in the tree."""
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", *SOURCES],
                         cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
  for f in filter(None, files):
    src = ROOT / f.decode()
    if src.is_file():
      (dst / f.decode()).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dst / f.decode())


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(venv folder, its python, the wheel) with the wheel installed."""
  tmp = tmp_path_factory.mktemp("package")
  src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
  _copy_sources(src)
  _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "--no-index", "-w", str(dist), str(src)])
  wheel, = dist.glob("jaxkv-*.whl")
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  py = venv / "bin" / "python"
  site = pathlib.Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                           "['purelib'])"]).stdout.strip())
  (site / "_jaxkv_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
        "--no-index", str(wheel)])
  return venv, py, wheel


def _env():
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  return {**env, "JAX_PLATFORMS": "cpu"}


def test_wheel_holds_the_package_data(installed):
  _, _, wheel = installed
  names = set(zipfile.ZipFile(wheel).namelist())
  assert {"jaxkv/py.typed", "jaxkv/_shipped/configs/smollm2.py",
          "jaxkv/_shipped/artifacts/smollm2-135m/pruner_head/manifest.json",
          "jaxkv/_shipped/artifacts/smollm2-135m/role_adapters/manifest.json",
          "jaxkv/commands/serve.py"} <= names
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
  entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
  text = zipfile.ZipFile(wheel).read(entry).decode()
  for cmd in ("jaxkv-serve", "jaxkv-server", "jaxkv-train-pruner", "jaxkv-train-lora"):
    assert f"{cmd} = jaxkv.commands." in text


def test_installed_package_resolves_its_own_files(installed, tmp_path):
  venv, py, _ = installed
  code = ("import json, jaxkv, jaxkv.commands.serve as s\n"
          "from jaxkv import artifacts, shipped\n"
          "print(json.dumps(dict(\n"
          "  init=jaxkv.__file__, version=jaxkv.__version__, serve=s.__file__,\n"
          "  head=str(artifacts.resolve(artifacts.PRUNER_HEAD)),\n"
          "  adapters=str(artifacts.resolve(artifacts.ROLE_ADAPTERS)),\n"
          "  config=shipped.config_file('configs/smollm2.py'),\n"
          "  bare=shipped.config_file('smollm2'),\n"
          "  checked=artifacts.verify(artifacts.PRUNER_HEAD)['model'])))\n")
  got = json.loads(_run([str(py), "-c", code], cwd=tmp_path, env=_env()).stdout)
  pkg = str(venv)
  assert all(got[k].startswith(pkg) for k in ("init", "serve", "head", "adapters", "config")), got
  assert got["head"].endswith("jaxkv/_shipped/artifacts/smollm2-135m/pruner_head")
  assert got["bare"] == got["config"] and got["checked"] == "smollm2-135m"
  version = next(x.split('"')[1] for x in (ROOT / "pyproject.toml").read_text().splitlines()
                 if x.startswith("version = "))
  assert got["version"] == version


def test_console_commands_run_the_default_job(installed, tmp_path):
  """`jaxkv-serve --config=configs/smollm2.py` from a directory without configs/:
  the installed package's own config; a bare name works too; every command's
  --help runs."""
  venv, _, _ = installed
  bin_ = venv / "bin"
  for cmd in ("jaxkv-server", "jaxkv-train-pruner", "jaxkv-train-lora"):
    assert "Config fields" in _run([str(bin_ / cmd), "--help"], cwd=tmp_path, env=_env()).stdout
  p = subprocess.run([str(bin_ / "jaxkv-serve"), "--config=smollm2", "--output=o.jsonl"],
                     capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
  assert p.returncode == 2 and p.stderr.startswith("jaxkv-serve: error: --input is required")
  (tmp_path / "in.jsonl").write_text(
      json.dumps({"id": "a", "messages": [{"role": "user", "content": "Say hi."}]}) + "\n"
      + json.dumps({"id": "b", "prompt": "The sky is"}) + "\n")
  env = {**_env(), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
  p = _run([str(bin_ / "jaxkv-serve"), "--config=configs/smollm2.py", "--input=in.jsonl",
            "--output=out.jsonl", "--config.sampling.max_tokens=2", "--noprogress"],
           cwd=tmp_path, env=env)
  recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert [r["id"] for r in recs] == ["a", "b"] and all(r["finish_reason"] != "error"
                                                        for r in recs), p.stderr[-2000:]
  assert not (tmp_path / "configs").exists()
