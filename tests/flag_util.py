"""A benchmark script's absl flags, defined and parsed for one test only: every bench
script defines its flags in `define_flags()`, and absl's registry is process-wide, so
a test that parses one script's flags must remove them again before the next script's
test defines its own (names such as --out and --model repeat)."""

from __future__ import annotations

import contextlib

from absl import flags


@contextlib.contextmanager
def script_flags(define, argv: list[str]):
  """Runs `define()` (a script's `define_flags`), parses `argv` (argv[0] is the
  program name), yields absl's FLAGS, then deletes the flags `define` added."""
  before = set(flags.FLAGS)
  define()
  added = set(flags.FLAGS) - before
  try:
    flags.FLAGS(argv)
    yield flags.FLAGS
  finally:
    for name in added:
      delattr(flags.FLAGS, name)
