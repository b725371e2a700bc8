"""What a user meets on the command line: config fields that can be listed and
checked, one-line errors, and an output file with one record per input line."""

import ast
import dataclasses
import json
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from jaxkv import cli
from jaxkv.config import ServeConfig, from_config_dict, to_config_dict
from jaxkv.engine import batch
from jaxkv.training import PrunerTrainConfig
from jaxkv.training.lora_train import LoraTrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_reference_lists_every_leaf_field_with_type_and_default():
  text = cli.reference(ServeConfig)
  leaves = list(cli.fields(ServeConfig))
  assert len(leaves) > 25
  for f in leaves:
    line = next(x for x in text.splitlines() if x.split()[:1] == [f"--{f.path}"])
    assert f.type_name in line and repr(f.default) in line
  assert "--config.cache.num_pages" in text and "Pages in the KV pool" in text
  for cls in (PrunerTrainConfig, LoraTrainConfig):     # the training scripts' configs
    assert len(list(cli.fields(cls))) > 3


# The config class of each command (jaxkv/commands/<name>.py: cli.run(_main, <class>, ...)).
COMMAND_CONFIGS = {"serve": ServeConfig, "server": ServeConfig,
                   "train_pruner": PrunerTrainConfig, "train_lora": LoraTrainConfig}


def test_every_command_config_field_is_described_in_full():
  """--help and the docs' configuration page describe every field from its comment:
  each leaf field of each command's config has one, a whole sentence (capital
  first, full stop last, brackets closed: not cut at the end of a line)."""
  for path in sorted((ROOT / "jaxkv/commands").glob("*.py")):
    if path.stem == "__init__":
      continue
    runs = [ast.unparse(n.args[1]) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "cli.run"]
    assert runs == [COMMAND_CONFIGS[path.stem].__name__], (path, runs)
  for cls in dict.fromkeys(COMMAND_CONFIGS.values()):
    for f in cli.fields(cls):
      assert f.doc, f"--{f.path} has no description"
      assert f.doc[0].isupper() and f.doc.endswith(".") and len(f.doc.split()) >= 3, \
          f"--{f.path}: {f.doc!r} is not a whole sentence"
      assert f.doc.count("(") == f.doc.count(")"), f"--{f.path}: {f.doc!r} is cut"


@dataclasses.dataclass(frozen=True)
class _Described:
  """Comment layouts `cli.fields` reads."""
  one: int = 1          # One line.
  two: str = "x#y"      # Continued on the next
                        # aligned comment line.
  # A comment heading the next field is not the previous field's.
  three: float = 3.0    # Three.
                        #
                        # After an empty comment line.
  bare: bool = False
  # the next line's comment is not aligned with this one's
  four: int = 4  # Four.
                        # Not part of four.


def test_descriptions_continue_on_aligned_comment_lines():
  docs = {f.path: f.doc for f in cli.fields(_Described)}
  assert docs == {"config.one": "One line.",
                  "config.two": "Continued on the next aligned comment line.",
                  "config.three": "Three. After an empty comment line.",
                  "config.bare": "", "config.four": "Four."}


def test_help_is_fast_and_loads_no_jax():
  """`--help` prints every field without importing JAX or the engine (it took
  2.4-3 s warm, up to 10 s cold, when `import jaxkv` loaded them)."""
  code = ("import sys, time\n"
          "t = time.perf_counter()\n"
          "sys.argv = ['jaxkv-serve', '--help']\n"
          "from jaxkv.commands import serve\n"
          "try:\n  serve.main()\nexcept SystemExit:\n  pass\n"
          "print('jax' in sys.modules, 'jaxkv.engine' in sys.modules, file=sys.stderr)\n")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                     cwd=ROOT)
  assert p.stderr.split() == ["False", "False"], p.stderr[-2000:]
  assert "--config.memart.neighbors" in p.stdout and "Config fields (ServeConfig" in p.stdout


@pytest.mark.parametrize("arg, expect", [
    ("--config.cache.nope=1", "--config.cache.nope: unknown config field (config.cache has: "
                              "num_pages, page_size, max_seq_len, dtype)"),
    ("--config.nope=1", "--config.nope: unknown config field (config has: model,"),
    ("--config.cache.num_pages=abc", "--config.cache.num_pages=abc: expects an int"),
    ("--config.sampling.top_p=1.5", "--config.sampling.top_p=1.5: top_p must be in (0, 1]"),
    ("--config.pruning.method=magic", "pruning.method must be one of"),
    ("--config.scan_layers=maybe", "expects a bool"),
    ("--config.engine.decode_steps", "needs a value"),
])
def test_bad_overrides_name_the_field(arg, expect):
  with pytest.raises(cli.ConfigError) as e:
    cli.check_overrides(["--input=x", arg], ServeConfig)
  assert expect in str(e.value)


def test_good_overrides_pass():
  cli.check_overrides(["--config.cache.num_pages=64", "--config.sampling.temperature=0.7",
                       "--config.scan_layers=true", "--config.model=/some/dir",
                       "--config=configs/smollm2.py", "--config.engine.max_batch", "4",
                       "--config.pruning.ablate_xattn"], ServeConfig)
  with pytest.raises(cli.ConfigError, match="expects an int"):
    cli.check_overrides(["--config.engine.max_batch", "four"], ServeConfig)


def test_tuple_overrides_parse_as_ml_collections_does():
  """A tuple field's override is read as a literal, as the config flag itself reads
  it (a string handed on became a tuple of its characters and was refused)."""
  from jaxkv.training.lora_train import LoraTrainConfig
  for text, want in [('("q","k","v","o")', ("q", "k", "v", "o")), ("1,2", (1, 2)),
                     ("['q']", ("q",)), ("v", ("v",)), ("q,k", ("q,k",))]:
    assert cli._parse_value(text, tuple) == want
  cli.check_overrides(['--config.targets=("q","k","v","o")', "--config.rank=4"],
                      LoraTrainConfig)
  with pytest.raises(cli.ConfigError, match=r"--config\.targets=q,x"):
    cli.check_overrides(["--config.targets=q,x"], LoraTrainConfig)


def test_config_files_are_type_and_range_checked():
  cd = to_config_dict(ServeConfig())
  d = cd.to_dict()
  d["cache"]["num_pages"] = "many"
  with pytest.raises(ValueError, match=r"config.cache.num_pages expects int, got str 'many'"):
    from_config_dict(ServeConfig, d)
  d["cache"]["num_pages"] = 1
  with pytest.raises(ValueError, match=r"^config.cache: need page_size >= 1"):
    from_config_dict(ServeConfig, d)
  d["cache"]["num_pages"], d["cache"]["bogus"] = 8, 1
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\] in config.cache"):
    from_config_dict(ServeConfig, d)
  ok = from_config_dict(ServeConfig, ml_collections.ConfigDict({"sampling": {"top_p": 1}}))
  assert ok.sampling.top_p == 1


def test_one_line_cuts_a_quoted_traceback():
  msg = ("flag --config=x.py: Error whilst parsing config file:\n\nTraceback (most recent "
         "call last):\n  File \"x.py\", line 3\nTypeError: bad keyword 'y'\n")
  assert cli.one_line(msg) == "flag --config=x.py: TypeError: bad keyword 'y'"


def _serve(*args, cwd=ROOT):
  return subprocess.run([sys.executable, str(ROOT / "scripts/serve.py"), *args],
                        capture_output=True, text=True, timeout=300, cwd=cwd)


def test_missing_required_flags_are_one_line_exit_2(tmp_path):
  """A left-out --input (or --config) is a usage error like any other: one line
  naming it, exit 2, no help text."""
  cases = [
      ([f"--config={ROOT}/configs/smollm2.py", f"--output={tmp_path}/o.jsonl"],
       "serve.py: error: --input is required, e.g. --config=configs/smollm2.py "
       "--input=examples/requests.jsonl --output=results.jsonl (--help lists every flag)"),
      ([], "serve.py: error: --config, --input and --output are required, e.g."),
  ]
  for args, expect in cases:
    p = _serve(*args)
    assert p.returncode == 2 and p.stdout == "", (args, p.stdout[-2000:])
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(expect), p.stderr
  p = subprocess.run([sys.executable, str(ROOT / "scripts/train_pruner.py")],
                     capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert p.returncode == 2 and p.stderr == ("train_pruner.py: error: --config is required, e.g. "
                                            "--config=configs/pruner_smollm2.py (--help lists "
                                            "every flag)\n"), p.stderr


def test_config_resolves_against_the_shipped_configs(tmp_path):
  """From a directory without configs/, `--config=configs/smollm2.py` and the bare
  name `smollm2` are the shipped config (jaxkv.shipped); a name that is neither
  lists the shipped ones. `--help` exits 0."""
  for spec in ("configs/smollm2.py", "smollm2", "smollm2.py"):
    p = _serve(f"--config={spec}", "--config.engine.max_batch=2", cwd=tmp_path)
    assert p.returncode == 2 and "--input and --output are required" in p.stderr, p.stderr
  p = _serve("--config=smollm3", "--input=x", "--output=y", cwd=tmp_path)
  assert p.returncode == 2 and p.stderr.startswith(
      "serve.py: error: --config=smollm3: no such config file (shipped configs: "), p.stderr
  assert "smollm2_memart" in p.stderr
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs/smollm2.py").write_text("raise ValueError('the user file wins')\n")
  p = _serve("--config=configs/smollm2.py", cwd=tmp_path)
  assert p.returncode == 2 and "the user file wins" in p.stderr
  assert _serve("--help", cwd=tmp_path).returncode == 0


@pytest.mark.slow
def test_serve_probes_fail_in_one_line_before_loading(tmp_path):
  cfg = f"--config={ROOT}/configs/smollm2.py"
  inp = ROOT / "examples/requests.jsonl"
  (tmp_path / "afile").write_text("")
  (tmp_path / "empty.jsonl").write_text("\n")
  (tmp_path / "bad.py").write_text(
      "from jaxkv.config import CacheConfig, ServeConfig, to_config_dict\n"
      "def get_config():\n  return to_config_dict(ServeConfig(cache=CacheConfig(pagez=3)))\n")
  cases = [
      ([cfg, f"--input={inp}", f"--output={tmp_path}"], "is a directory"),
      ([cfg, f"--input={inp}", f"--output={tmp_path}/afile/out.jsonl"], "afile is a file"),
      ([cfg, f"--input={inp}", f"--output={tmp_path}/o.jsonl", "--config.cache.nope=1"],
       "unknown config field"),
      ([f"--config={tmp_path}/bad.py", f"--input={inp}", f"--output={tmp_path}/o.jsonl"],
       "unexpected keyword argument 'pagez'"),
      (["--config=nope.py", f"--input={inp}", f"--output={tmp_path}/o.jsonl"],
       "no such config file"),
      ([cfg, f"--input={inp}", f"--output={tmp_path}/o.jsonl",
        "--config.model=/no/such/model.gguf"], "/no/such/model.gguf does not exist"),
      ([f"--config={ROOT}/configs/smollm2_sessions.py", f"--input={tmp_path}/tau2.json",
        f"--output={tmp_path}/o.jsonl"], "scripts/make_traces.py --source=tau2"),
  ]
  for args, expect in cases:
    p = _serve(*args)
    err = [x for x in p.stderr.splitlines() if "error" in x.lower()]
    assert p.returncode == 2 and len(err) == 1 and expect in err[0], (args, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
  p = _serve(cfg, f"--input={tmp_path}/empty.jsonl", f"--output={tmp_path}/o.jsonl")
  assert p.returncode == 0 and "nothing to do" in p.stderr and "loaded" not in p.stderr
  p = _serve("--helpfull")
  assert "--config.pruning.budget" in p.stdout and "--config.engine.decode_steps" in p.stdout


def test_broken_hf_config_names_the_file(tmp_path):
  from jaxkv.models import weights
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match=f"{tmp_path}/config.json is not valid JSON"):
    weights.load_hf_dir(tmp_path)


def test_result_file_keeps_one_record_per_input_line(tmp_path):
  out = tmp_path / "out.jsonl"
  first = [{"id": "a", "text": "x", "finish_reason": "stop"},
           {"id": "line:2", "error": "line 2: invalid JSON", "finish_reason": "error"},
           {"id": "b", "error": "too long", "finish_reason": "error"},
           {"id": "gone", "text": "kept", "finish_reason": "stop"},
           {"id": "old-error", "error": "e", "finish_reason": "error"}]
  out.write_text("".join(json.dumps(r) + "\n" for r in first) + '{"id": "trunc')
  f = batch.ResultFile(out)
  assert f.done == {"a", "gone"}
  f.add({"id": "fixed", "text": "y", "finish_reason": "stop"})     # line 2, now valid
  f.add({"id": "b", "text": "z", "finish_reason": "length"})       # retried, now fits
  assert f.finish(["a", "fixed", "b"]) == 4
  recs = [json.loads(x) for x in out.read_text().splitlines()]
  assert [r["id"] for r in recs] == ["a", "fixed", "b", "gone"]
  assert recs[2]["text"] == "z" and not (tmp_path / "out.jsonl.tmp").exists()
  # an interrupted run: its records were appended and flushed before the rewrite
  g = batch.ResultFile(out)
  g.add({"id": "c", "text": "w", "finish_reason": "stop"})
  assert json.loads(out.read_text().splitlines()[-1])["id"] == "c"
  assert batch.ResultFile(out).done == {"a", "fixed", "b", "gone", "c"}
  # killed mid-write and never finished: the next run's first record is not glued to
  # the torn line, so a third run still sees it
  out.write_text(out.read_text() + '{"id": "torn", "te')
  h = batch.ResultFile(out)
  h.add({"id": "d", "text": "v", "finish_reason": "stop"})
  h._f.close()
  assert batch.ResultFile(out).done == {"a", "fixed", "b", "gone", "c", "d"}


def test_read_requests_lists_every_line_once(tmp_path):
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join([
      json.dumps({"id": "a", "prompt": "p"}), "{broken",
      json.dumps({"id": "a", "prompt": "dup"}),
      json.dumps({"id": "c", "prompt": "p", "max_token": 3}),
      json.dumps({"id": "c", "prompt": "p"}), ""]))
  order, errors = [], []
  reqs = list(batch.read_requests(src, lambda p, t: [1, 2], ServeConfig().sampling, set(),
                                  errors.append, order))
  assert [r.id for r in reqs] == ["a"]
  assert order == ["a", "line:2", "a@line:3", "c", "c@line:5"]
  assert [e.rid for e in errors] == ["line:2", "a@line:3", "c", "c@line:5"]
  # the column of the file's line (a line parsed with its newline had every error at column 1)
  assert str(errors[0]) == ("line 2: invalid JSON at column 2: Expecting property name "
                            "enclosed in double quotes")


def test_a_line_names_its_kv_mechanism():
  defaults = ServeConfig().sampling
  p = batch.parse_line(json.dumps({"id": "m", "prompt": "p", "kind": "memart", "user": "u"}),
                       1, defaults)
  assert (p.kind, p.user) == ("memart", "u")
  assert batch.parse_line(json.dumps({"id": "x", "prompt": "p"}), 2, defaults).kind is None
  with pytest.raises(batch.RequestError, match="'kind' must be one of pruned, memart"):
    batch.parse_line(json.dumps({"id": "b", "prompt": "p", "kind": "prefix"}), 3, defaults)
  a = batch.parse_line(json.dumps({"id": "a", "prompt": "p", "kind": "agents", "role": "plan",
                                   "user": "t"}), 4, defaults)
  assert (a.kind, a.role, a.user) == ("agents", "plan", "t")
  # a list composes the kinds in one session, named as the server names it
  c = batch.parse_line(json.dumps({"id": "c", "prompt": "p", "kind": ["reuse", "memart",
                                                                        "pruned", "memart"]}),
                       6, defaults)
  assert c.kind == "pruned+memart+reuse" and c.role is None
  assert batch.parse_line(json.dumps({"id": "g", "prompt": "p", "role": "plan",
                                      "kind": ["pruned", "agents"]}), 7, defaults).kind == (
      "agents+pruned")
  for bad, why in (({"kind": "agents"}, "names its role adapter"),
                   ({"kind": ["pruned", "agents"]}, "names its role adapter"),
                   ({"role": "plan"}, "give \"kind\": \"agents\""),
                   ({"kind": "agents", "role": 3}, "'role' must be"),
                   ({"kind": ["pruned", "prefix"]}, "or a list of them"),
                   ({"kind": []}, "or a list of them")):
    with pytest.raises(batch.RequestError, match=why):
      batch.parse_line(json.dumps({"id": "r", "prompt": "p", **bad}), 5, defaults)


def test_missing_traces_name_the_command_that_makes_them(tmp_path):
  from jaxkv.data import traces
  with pytest.raises(FileNotFoundError, match=r"scripts/make_traces\.py --source=tau2"):
    traces.load_toolbench(tmp_path / "tau2_train.json")
  p = subprocess.run([sys.executable, str(ROOT / "scripts/train_pruner.py"),
                      f"--config={ROOT}/configs/pruner_smollm2.py",
                      f"--config.train_traces={tmp_path}/tau2_train.json",
                      f"--config.cache_dir={tmp_path}/cache", f"--config.out_dir={tmp_path}/run"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert "scripts/make_traces.py" in p.stderr.splitlines()[-1]
