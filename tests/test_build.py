"""Keeps BUILD in step with the tree.

Every module is in a py_library and every test file in a py_test; every listed
source exists; every dep and data entry is a defined target; and each py_library,
py_binary and py_test's deps are exactly the targets owning what its srcs import.

Imports are read with `ast` at every level (module top, functions, try blocks):
  - `jaxkv.*` / `pallas_kernels.*` modules map to the target listing their file;
    `import jaxkv` and `from jaxkv.policies.pruning import keep_mask` map to the
    package's `__init__.py` (a target listing a package's `__init__.py` stands for
    the package); `from jaxkv.kv import state` maps to `jaxkv/kv/state.py`.
    Importing `a.b.c` does not count the parents' `__init__.py` files (as in Bazel).
  - A bare `import name` naming a file of the repo's script folders (bench/,
    scripts/, tests/) is a relative-file import: it maps to the target owning that
    file. The file must sit beside the importer, or the importer must put its
    folder on sys.path (tests do `sys.path.insert(0, ... / "bench")`).
  - Anything else is third-party or the standard library and is not a BUILD dep.
py_binary (bench/, scripts/) and py_test targets follow the same rule as
py_library: deps equal imports, nothing more. A script a target only runs (a
subprocess, the sharding worker) is `data`, not a dep, and its file name must
appear in the target's sources. tests/conftest.py (target `conftest`) is loaded by
pytest for every test, never imported: it is an implicit dep that no py_test lists.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxkv", "pallas_kernels")
SCRIPT_DIRS = ("bench", "scripts", "tests")   # hold modules imported by bare file name
PY_RULES = ("py_library", "py_binary", "py_test")
IMPLICIT = {"conftest"}                        # pytest loads it; no py_test lists it


def _targets():
  """Parses BUILD (Starlark is a Python subset) into {name: (rule, srcs, deps, data)}."""
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
    out[kw["name"]] = (rule, kw.get("srcs", []), kw.get("deps", []), kw.get("data", []))
  return out


def _owners(targets):
  """{source path: the one py target listing it}."""
  owners = {}
  for name, (rule, srcs, _, _) in targets.items():
    if rule not in PY_RULES:
      continue
    for s in srcs:
      assert s not in owners, f"BUILD: {s} is in both {owners[s]!r} and {name!r}"
      owners[s] = name
  return owners


def _package_module(dotted):
  """The file of first-party module `dotted` (a package's __init__.py), or None."""
  base = ROOT.joinpath(*dotted.split("."))
  for f in (base / "__init__.py", base.with_suffix(".py")):
    if f.is_file():
      return str(f.relative_to(ROOT))
  return None


def _sys_path_dirs(tree):
  """The script folders a file puts on sys.path (`sys.path.insert(0, ... / "bench")`,
  `sys.path[:0] = [...]`): statements naming sys.path and a folder's name."""
  dirs = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      head = ast.unparse(node.func)
    elif isinstance(node, ast.Assign):
      head = " ".join(ast.unparse(t) for t in node.targets)
    elif isinstance(node, ast.AugAssign):
      head = ast.unparse(node.target)
    else:
      continue
    if head.startswith("sys.path"):
      dirs |= {c.value for c in ast.walk(node)
               if isinstance(c, ast.Constant) and c.value in SCRIPT_DIRS}
  return dirs


def _imports(src):
  """The repo files `src` imports, and problems found resolving them."""
  path = ROOT / src
  tree = ast.parse(path.read_text(), filename=src)
  on_path = {path.parent.relative_to(ROOT).as_posix()} | _sys_path_dirs(tree)
  files, problems = set(), []

  def first_party(dotted, names=()):
    base = _package_module(dotted)
    if base is None:
      problems.append(f"{src} imports {dotted}, which is no module of the repo")
      return
    for n in names:   # `from pkg import module` imports the module itself
      sub = _package_module(f"{dotted}.{n}")
      files.add(sub if sub is not None else base)
    if not names:
      files.add(base)

  def script_file(top):
    hits = [d for d in SCRIPT_DIRS if (ROOT / d / f"{top}.py").is_file()]
    if not hits:
      return   # standard library or third party
    if len(hits) > 1 and not set(hits) & on_path:
      problems.append(f"{src}: `import {top}` is ambiguous between {hits}")
      return
    found = [d for d in hits if d in on_path]
    if not found:
      problems.append(f"{src} imports {hits[0]}/{top}.py without putting {hits[0]}/ on "
                      "sys.path")
      return
    files.add(f"{found[0]}/{top}.py")

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        top = alias.name.split(".")[0]
        if top in PACKAGES:
          first_party(alias.name)
        else:
          script_file(top)
    elif isinstance(node, ast.ImportFrom):
      names = [a.name for a in node.names if a.name != "*"]
      if node.level:   # relative: resolve against the importer's package
        pkg = path.relative_to(ROOT).parent.parts
        pkg = pkg[:len(pkg) - node.level + 1]
        dotted = ".".join(pkg + ((node.module,) if node.module else ()))
        first_party(dotted, names)
      elif node.module.split(".")[0] in PACKAGES:
        first_party(node.module, names)
      else:
        script_file(node.module.split(".")[0])
  return files, problems


def test_every_module_and_test_has_a_target():
  targets = _targets()
  lib_srcs = {s for rule, srcs, _, _ in targets.values() if rule == "py_library" for s in srcs}
  test_srcs = {s for rule, srcs, _, _ in targets.values() if rule == "py_test" for s in srcs}
  modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
  tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
  assert modules - lib_srcs == set(), f"modules without a py_library: {sorted(modules - lib_srcs)}"
  assert tests - test_srcs == set(), f"tests without a py_test: {sorted(tests - test_srcs)}"


def test_every_listed_source_exists_and_deps_resolve():
  targets = _targets()
  for name, (_, srcs, deps, data) in targets.items():
    for s in srcs:
      assert (ROOT / s).exists(), f"BUILD target {name!r} lists missing file {s}"
    for d in deps + data:
      if d.startswith(":"):
        assert d[1:] in targets, f"BUILD target {name!r} depends on unknown {d}"


def test_deps_equal_imports():
  """Each py target's deps are exactly the targets owning what its srcs import."""
  targets = _targets()
  owners = _owners(targets)
  report = []
  for name, (rule, srcs, deps, _) in sorted(targets.items()):
    if rule not in PY_RULES:
      continue
    want, problems = set(), []
    for s in srcs:
      files, probs = _imports(s)
      problems += probs
      for f in sorted(files):
        if f not in owners:
          problems.append(f"{s} imports {f}, which no target lists")
        elif owners[f] != name:
          want.add(owners[f])
    listed = [d[1:] for d in deps if d.startswith(":")]
    have = set(listed)
    dupes = sorted({d for d in listed if listed.count(d) > 1})
    lines = []
    for label, names in (("missing deps", want - have), ("extra deps (not imported)", have - want),
                         ("listed twice", dupes)):
      if names:
        lines.append(f"  {label}: {', '.join(':' + d for d in sorted(names))}")
    lines += [f"  {p}" for p in problems]
    if lines:
      report.append(f"{rule}(name = {name!r}):\n" + "\n".join(lines))
  assert not report, "BUILD deps differ from the imports:\n" + "\n".join(report)


def test_data_targets_are_named_by_their_users():
  """A target run rather than imported (`data`) is named, by file, in its user's sources."""
  targets = _targets()
  for name, (rule, srcs, deps, data) in targets.items():
    if rule not in PY_RULES:
      continue
    text = "\n".join((ROOT / s).read_text() for s in srcs)
    for d in data:
      assert d.startswith(":") and d[1:] in targets, f"{name!r}: unknown data {d}"
      for f in targets[d[1:]][1]:
        assert pathlib.PurePath(f).name in text, (
            f"{name!r} lists {d} as data but its sources never name {f}")
    for d in IMPLICIT:
      assert f":{d}" not in deps, f"{name!r} lists the implicit :{d}"


def test_deps_have_no_cycles():
  """Bazel rejects a dependency cycle; a function-level import is no way around it."""
  targets = _targets()
  graph = {n: [d[1:] for d in deps + data if d.startswith(":")]
           for n, (_, _, deps, data) in targets.items()}
  state = {}   # name -> 1 on the current path, 2 done

  def visit(n, path):
    if state.get(n) == 2:
      return
    assert state.get(n) != 1, "BUILD dependency cycle: " + " -> ".join(
        path[path.index(n):] + [n])
    state[n] = 1
    for d in graph.get(n, []):
      visit(d, path + [n])
    state[n] = 2

  for n in sorted(graph):
    visit(n, [])


# What serves requests (the engine, its runners, the server, the serving commands and
# the artifacts they load) never depends on the trainers: serving installs and runs
# without the training code path (Optax loops, feature extraction).
SERVING = ("engine", "server_", "commands_serve", "commands_server", "artifacts", "jaxkv")


def test_serving_does_not_depend_on_training():
  targets = _targets()
  graph = {n: [d[1:] for d in deps if d.startswith(":")]
           for n, (_, _, deps, _) in targets.items()}
  serving = [n for n in targets if targets[n][0] == "py_library"
             and (n == "jaxkv" or n.startswith(SERVING[:-1]))]
  assert "engine" in serving and "server_app" in serving and "artifacts" in serving
  for start in serving:
    seen, todo = set(), [(start, [start])]
    while todo:
      n, path = todo.pop()
      assert not n.startswith("training"), (
          "serving depends on training: " + " -> ".join(path))
      for d in graph.get(n, []):
        if d not in seen:
          seen.add(d)
          todo.append((d, path + [d]))
