"""Keeps BUILD in step with the tree: every module in a py_library, every test
file in a py_test, every listed source present, every dep a defined target."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxkv", "pallas_kernels")


def _targets():
  """Parses BUILD (Starlark is a Python subset) into {name: (rule, srcs, deps)}."""
  tree = ast.parse((ROOT / "BUILD").read_text())
  out = {}
  for node in tree.body:
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
      continue
    call = node.value
    rule = call.func.id
    if rule == "load":
      continue
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert kw["name"] not in out, f"BUILD: duplicate target {kw['name']!r}"
    out[kw["name"]] = (rule, kw.get("srcs", []), kw.get("deps", []))
  return out


def test_every_module_and_test_has_a_target():
  targets = _targets()
  lib_srcs = {s for rule, srcs, _ in targets.values() if rule == "py_library" for s in srcs}
  test_srcs = {s for rule, srcs, _ in targets.values() if rule == "py_test" for s in srcs}
  modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
  tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
  assert modules - lib_srcs == set(), f"modules without a py_library: {sorted(modules - lib_srcs)}"
  assert tests - test_srcs == set(), f"tests without a py_test: {sorted(tests - test_srcs)}"


def test_every_listed_source_exists_and_deps_resolve():
  targets = _targets()
  for name, (_, srcs, deps) in targets.items():
    for s in srcs:
      assert (ROOT / s).exists(), f"BUILD target {name!r} lists missing file {s}"
    for d in deps:
      if d.startswith(":"):
        assert d[1:] in targets, f"BUILD target {name!r} depends on unknown {d}"
