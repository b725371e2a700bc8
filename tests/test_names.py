"""Every `module.name` read through an imported first-party module names something that
module defines: a static check (`ast`, nothing imported) that catches a helper renamed
or removed while another file still calls it, which a linter cannot see and only the
caller's own tests would find (once in the slow suite: `train._append_json`).

A module's names are what its top level binds: functions, classes, assignments
(inside top-level if / try / with / for too), imports, names declared `global`, and a
package's submodules. Modules that define `__getattr__` (lazy packages) or star-import
are skipped, as are aliases a function rebinds.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxkv", "pallas_kernels")
SCRIPT_DIRS = ("bench", "scripts", "tests")
SOURCES = [p for d in PACKAGES + SCRIPT_DIRS for p in sorted((ROOT / d).rglob("*.py"))]


def _module_file(dotted: str) -> pathlib.Path | None:
  base = ROOT.joinpath(*dotted.split("."))
  for f in (base / "__init__.py", base.with_suffix(".py")):
    if f.is_file():
      return f
  return None


def _bound(stmts) -> set[str]:
  """Names the statements bind at their own level (not inside defs / classes)."""
  names = set()
  for s in stmts:
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(s.name)
      names |= {n for g in ast.walk(s) if isinstance(g, ast.Global) for n in g.names}
    elif isinstance(s, (ast.Import, ast.ImportFrom)):
      names |= {(a.asname or a.name).split(".")[0] for a in s.names}
    elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
      targets = s.targets if isinstance(s, ast.Assign) else [s.target]
      names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for field in ("body", "orelse", "finalbody"):
      if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names |= _bound(getattr(s, field, []))
    for h in getattr(s, "handlers", []):
      names |= _bound(h.body)
  return names


_NAMES: dict[pathlib.Path, set[str] | None] = {}


def _names(path: pathlib.Path) -> set[str] | None:
  """The names module `path` defines; None when they cannot be known statically."""
  if path not in _NAMES:
    tree = ast.parse(path.read_text())
    star = any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
               for n in tree.body)
    names = _bound(tree.body)
    if path.name == "__init__.py":
      names |= {p.stem if p.suffix == ".py" else p.name for p in path.parent.iterdir()}
    _NAMES[path] = None if star or "__getattr__" in names else names
  return _NAMES[path]


def _aliases(path: pathlib.Path, tree) -> dict[str, pathlib.Path]:
  """Local name -> first-party module file, for the module imports of `path`."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        top = a.name.split(".")[0]
        if top in PACKAGES and a.asname:
          f = _module_file(a.name)
        elif "." not in a.name and not a.asname and top not in PACKAGES:
          hits = [ROOT / d / f"{top}.py" for d in SCRIPT_DIRS if (ROOT / d / f"{top}.py").is_file()]
          f = hits[0] if len(hits) == 1 else None
        else:
          continue
        if f is not None:
          out[a.asname or a.name] = f
    elif (isinstance(node, ast.ImportFrom) and node.module and not node.level
          and node.module.split(".")[0] in PACKAGES):
      for a in node.names:
        f = _module_file(f"{node.module}.{a.name}")
        if f is not None:
          out[a.asname or a.name] = f
  rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Store)}
  rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.args + n.kwonlyargs + n.posonlyargs}
  return {k: v for k, v in out.items() if k not in rebound}


def _reads(path: pathlib.Path, tree) -> list[tuple[int, pathlib.Path, str]]:
  """(line, module file, name) of each `alias.name` read through a module alias."""
  aliases = _aliases(path, tree)
  return sorted((node.lineno, aliases[node.value.id], node.attr) for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name) and node.value.id in aliases)


def _missing(path: pathlib.Path, tree) -> list[str]:
  return [f"{path.name}:{line}: {mod.relative_to(ROOT)} defines no {name!r}"
          for line, mod, name in _reads(path, tree)
          if _names(mod) is not None and name not in _names(mod)]


def test_module_attributes_exist():
  missing, checked = [], 0
  for path in SOURCES:
    tree = ast.parse(path.read_text(), filename=str(path))
    checked += len(_reads(path, tree))
    missing += _missing(path, tree)
  assert checked > 2000, f"only {checked} module reads found: the alias resolution broke"
  assert not missing, "names read from modules that do not define them:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_name(tmp_path):
  """A removed helper read through its module is reported; present names are not."""
  tree = ast.parse("import common\nfrom jaxkv import jsonl\nfrom jaxkv.training import "
                   "train as t\njsonl.append(1)\nt._append_json(1)\ncommon.Journal\n"
                   "common.nope\n")
  assert _missing(tmp_path / "x.py", tree) == [
      "x.py:5: jaxkv/training/train.py defines no '_append_json'",
      "x.py:7: bench/common.py defines no 'nope'"]
