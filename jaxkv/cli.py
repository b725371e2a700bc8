"""Command-line plumbing of the commands (`jaxkv.commands`): config fields you can
find and check.

    from jaxkv import cli
    _CONFIG = config_flags.DEFINE_config_file("config", ...)
    ...
    cfg = cli.load_config(ServeConfig, _CONFIG.value)   # one-line error, exit 2
    ...
    cli.run(main, ServeConfig, doc=__doc__)   # app.run with checked flags; --help
                                              # prints __doc__ and every field

Every `--config.<path>=<value>` override is checked against the dataclass
before the config file is even read: an unknown field, a value of the wrong
type or one out of range gives one line naming the field and what it takes,
and exit status 2, with no traceback. The same holds for a config file that
sets a field the dataclass lacks or a value its checks refuse.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterator

from jaxkv.config import dataclass_type


def _comments(cls: type) -> dict[str, str]:
  """Field name -> its description: the field's trailing `# comment` in the class
  source, continued on the comment-only lines right below it whose `#` stands in
  the same column (a comment at another column, e.g. one heading the next field,
  is not part of it). Fields without a trailing comment are left out."""
  try:
    src = textwrap.dedent(inspect.getsource(cls))
  except (OSError, TypeError):
    return {}
  comments: dict[int, tuple[int, str]] = {}    # line -> (column of '#', text)
  code: set[int] = set()                       # lines holding code
  for tok in tokenize.generate_tokens(io.StringIO(src).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = (tok.start[1], tok.string[1:].strip())
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
      code.update(range(tok.start[0], tok.end[0] + 1))
  out = {}
  for node in ast.parse(src).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    own = [n for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    if not own:
      continue
    col, first = comments[own[0]]
    parts, n = [first], node.end_lineno + 1
    while n in comments and n not in code and comments[n][0] == col:
      parts.append(comments[n][1])
      n += 1
    out[node.target.id] = " ".join(p for p in parts if p)
  return out


def _type_name(hint) -> str:
  if isinstance(hint, type):
    return hint.__name__
  return str(hint).replace("typing.", "")


@dataclasses.dataclass(frozen=True)
class Field:
  path: str          # e.g. "config.cache.num_pages"
  hint: object       # the annotation
  default: object
  doc: str

  @property
  def type_name(self) -> str:
    return _type_name(self.hint)


def fields(cls: type, prefix: str = "config") -> Iterator[Field]:
  """Every leaf field of a (nested) config dataclass: each group's own fields, the
  root group first."""
  for path, group in _groups(cls, prefix).items():
    hints, docs, inst = typing.get_type_hints(group), _comments(group), group()
    for f in dataclasses.fields(group):
      if dataclass_type(hints[f.name]) is None:
        yield Field(f"{path}.{f.name}", hints[f.name], getattr(inst, f.name),
                    docs.get(f.name, ""))


def reference(cls: type, prefix: str = "config", width: int = 100) -> str:
  """A text reference of every `--config.*` field: its path, type and default on one
  line, its description wrapped below it."""
  rows = [(f"--{f.path}", f.type_name, repr(f.default), f.doc) for f in fields(cls, prefix)]
  w = [max(len(r[i]) for r in rows) for i in range(2)]
  lines = [f"Config fields ({cls.__name__}; override any with --{prefix}.<field>=<value>):"]
  for path, type_name, default, doc in rows:
    lines.append(f"  {path:<{w[0]}}  {type_name:<{w[1]}}  {default}")
    lines += textwrap.wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                           break_on_hyphens=False)
  return "\n".join(lines)


def with_reference(doc: str | None, cls: type) -> str:
  """A script docstring with the field reference appended ('%' escaped: absl
  formats the main module's docstring into its --help output)."""
  return (doc or "") + "\n" + reference(cls).replace("%", "%%") + "\n"


class ConfigError(ValueError):
  """A config override or file that the config dataclass refuses."""


def _leaf_map(cls: type) -> dict[str, Field]:
  return {f.path: f for f in fields(cls)}


def _groups(cls: type, prefix: str = "config") -> dict[str, type]:
  """Dotted path -> dataclass for the root and every nested config."""
  out = {prefix: cls}
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    sub = dataclass_type(hints[f.name])
    if sub is not None:
      out.update(_groups(sub, f"{prefix}.{f.name}"))
  return out


def _parse_value(text: str, hint) -> object:
  """An override's text as the field's type (raises ValueError naming the type)."""
  args = typing.get_args(hint)
  if args and type(None) in args:
    if text in ("None", "none", ""):
      return None
    hint = next(a for a in args if a is not type(None))
  if hint is bool:
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ValueError("expects a bool (true / false)")
  if hint is int:
    try:
      return int(text)
    except ValueError:
      raise ValueError("expects an int") from None
  if hint is float:
    try:
      return float(text)
    except ValueError:
      raise ValueError("expects a float") from None
  if hint is tuple or typing.get_origin(hint) is tuple:
    # as ml_collections reads it: a Python literal ('("q","k")', "1,2"), a bare word
    # a one-element tuple (a string handed on would split into its characters)
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
  return text


def check_overrides(argv: list[str], cls: type, flag: str = "config") -> None:
  """Checks every `--config.<path>=<value>` in argv against `cls`.

  Raises ConfigError naming the field and what it takes: unknown fields (with
  the known ones of that group), values not of the field's type, and values the
  group's own checks refuse (e.g. out of range).
  """
  leaves, groups = _leaf_map(cls), _groups(cls)
  for k, arg in enumerate(argv):
    m = re.match(rf"^--{flag}\.([\w.]+)(?:=(.*))?$", arg)
    if not m:
      continue
    path, text = f"{flag}.{m.group(1)}", m.group(2)
    f = leaves.get(path)
    if f is None:
      parent, _, name = path.rpartition(".")
      known = [x.name for x in dataclasses.fields(groups[parent])] if parent in groups else []
      where = f"{parent} has: {', '.join(known)}" if known else \
          f"config groups: {', '.join(sorted(groups))}"
      raise ConfigError(f"--{path}: unknown config field ({where})")
    if text is None:                    # "--config.x value", or a bare bool flag
      nxt = argv[k + 1] if k + 1 < len(argv) else None
      if f.hint is bool:
        text = "true"
      elif nxt is not None and not nxt.startswith("--"):
        text = nxt
      else:
        raise ConfigError(f"--{path} needs a value: --{path}=<{f.type_name}>")
    try:
      value = _parse_value(text, f.hint)
    except ValueError as e:
      raise ConfigError(f"--{path}={text}: {e}") from None
    # the group's own checks (ranges, choices), on the defaults plus this value
    parent, _, name = path.rpartition(".")
    try:
      dataclasses.replace(groups[parent](), **{name: value})
    except (TypeError, ValueError) as e:
      raise ConfigError(f"--{path}={text}: {e}") from None


def load_config(cls: type, cd) -> object:
  """`config.from_config_dict`, with a refusal turned into a one-line exit(2)."""
  from jaxkv.config import from_config_dict
  try:
    return from_config_dict(cls, cd)
  except (TypeError, ValueError, OSError) as e:
    fail(str(e))


def load_llm(cfg, agents: bool | None = None):
  """`jaxkv.load` for a ServeConfig (on its mesh); a missing or unreadable model,
  or a mesh the devices do not allow, is a one-line error (exit 2). `agents`: whether
  LRAgent agents sessions run (None: when `server.sessions` names them); under a
  decoupled `server.agent_scheme` the pool then keeps the low-rank value cache and
  the engine runs every adapter row decoupled."""
  import jaxkv
  mesh = None
  try:
    if cfg.mesh.size > 1:
      from jaxkv import sharding
      mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.model)
  except ValueError as e:
    fail(f"--config.mesh: {e}")
  try:
    # the commands print their own progress and set the cache from --xla_cache
    llm = jaxkv.load(cfg.model, dtype=cfg.dtype, cache=cfg.cache, engine=cfg.engine,
                     scan_layers=cfg.scan_layers, mesh=mesh, verbose=False,
                     compilation_cache=False)
  except (FileNotFoundError, ValueError) as e:
    fail(f"--config.model={cfg.model}: {e}")
  path = cfg.server.role_adapters
  if path:
    from jaxkv import artifacts
    from jaxkv.data import agents
    try:
      if path == "shipped":
        _, llm.lora = artifacts.load_role_adapters(llm.config, model_name=cfg.model)
      else:
        _, llm.lora = artifacts.load_role_adapters(llm.config, path)
    except (FileNotFoundError, ValueError) as e:
      fail(f"--config.server.role_adapters={path}: {e}")
    llm.adapters = agents.ROLES
    from jaxkv.config import session_kinds
    from jaxkv.policies.sharing import lragent
    if agents is None:
      agents = "agents" in session_kinds(cfg.server.sessions)
    if agents and cfg.server.agent_scheme in lragent.DECOUPLED:
      llm.kv_lr_rank = llm.lora.rank   # the one pool keeps the low-rank value cache too
  return llm


def compilation_cache(path: str | None) -> None:
  """Keeps compiled steps on disk between runs (JAX's persistent cache, the one
  `jaxkv.load` uses: `jaxkv.runtime.compilation_cache`): `path`, or
  $JAX_COMPILATION_CACHE_DIR, or ~/.cache/jaxkv/xla when None; "" turns it off."""
  from jaxkv import runtime
  runtime.compilation_cache(path)


def one_line(msg: str) -> str:
  """An error message as one line: a quoted traceback is cut to its last line."""
  if "Traceback (most recent call last)" in msg:
    head = msg.split(":", 1)[0]
    last = [x for x in msg.splitlines() if x.strip()][-1]
    msg = f"{head}: {last}"
  return " ".join(msg.split())


def fail(msg: str, code: int = 2) -> typing.NoReturn:
  """One line on stderr, prefixed with the script's name; exit `code`."""
  prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv else "jaxkv"
  print(f"{prog}: error: {one_line(msg)}", file=sys.stderr)
  sys.exit(code)


def require(given: dict[str, object], example: str) -> None:
  """One line naming the required flags left out (None), with an example; exit 2."""
  missing = [name for name, value in given.items() if value is None]
  if missing:
    names = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
    fail(f"{names} {'are' if len(missing) > 1 else 'is'} required, e.g. {example} "
         "(--help lists every flag)")


_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _config_arg(arg: str, flag: str) -> str:
  """`--config=<file>[:arg]` with the file resolved (`jaxkv.shipped.config_file`: as
  given, else a shipped config by path or bare name); other args as they are."""
  from jaxkv import shipped
  if not arg.startswith(f"--{flag}="):
    return arg
  spec, colon, rest = arg.split("=", 1)[1].partition(":")   # "file.py:arg" passes an argument
  if not spec:
    return arg
  path = shipped.config_file(spec)
  if path is None:
    raise ConfigError(f"--{flag}={spec}: no such config file (shipped configs: "
                      f"{', '.join(shipped.config_names())})")
  return f"--{flag}={path}{colon}{rest}"


def run(main: Callable, cls: type | None = None, flag: str = "config",
        doc: str | None = None) -> None:
  """`absl.app.run(main)` whose flag parsing checks `--config.*` overrides first
  and reports any flag or config-file error, and a missing input file raised by
  `main` (FileNotFoundError), as one line (exit 2).

  doc: the command's usage text (its module docstring); `--help` prints it with
  the field reference of `cls` appended. absl reads the usage from `__main__`,
  which is the console-script wrapper or `scripts/*.py` rather than the command's
  module, so it is set there.
  """
  from absl import app, flags

  if doc is not None:
    sys.modules["__main__"].__doc__ = with_reference(doc, cls) if cls is not None else doc

  def parse(argv):
    try:
      argv = [argv[0], *(_config_arg(arg, flag) for arg in argv[1:])]
      if cls is not None:
        check_overrides(argv[1:], cls, flag)
      return flags.FLAGS(argv)
    except ConfigError as e:
      fail(str(e))
    except flags.Error as e:
      fail(f"{one_line(str(e))} (--helpfull lists every flag and config field)")
    except BrokenPipeError:   # `--help | head`: the reader stopped early; nothing is wrong
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      sys.exit(0)
    except SystemExit as e:   # absl exits 1 after printing the help a user asked for
      if e.code == 1 and any(a in _HELP_FLAGS for a in argv[1:]):
        sys.exit(0)
      raise
    except Exception as e:   # a config file's own error, shown as one line
      fail(f"--{flag}: {type(e).__name__}: {e}")

  def guarded(argv):
    try:
      return main(argv)
    except FileNotFoundError as e:    # a missing input names itself (and its maker)
      fail(str(e).strip('"'))

  app.run(guarded, flags_parser=parse)
