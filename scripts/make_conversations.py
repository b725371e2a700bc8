r"""Builds MemArt development conversations in LoCoMo's JSON format from the real
human dialogue of the `chitchat-dataset` package (never committed; see docs/data.md).

    python scripts/make_conversations.py --out=data_local/conversations.json \
        [--samples=4] [--tokens=8000] [--recall=20] [--planted=6] [--seed=0] \
        [--tokenizer_model=smollm2-135m]

Each sample concatenates chitchat conversations, one per session (in the order
of their timestamps), until the rendered history reaches --tokens tokens of the
model's tokenizer; --recall questions ask for an utterance that followed a
quoted one (real, evidence = its dia_id), --planted facts are inserted as
synthetic turns with a question each (`"synthetic": true` on both). A LoCoMo
file (locomo10.json) can be fed to bench/memart.py the same way.
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxkv.data import conversations as C

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", None, "conversations JSON to write (LoCoMo format)")
  flags.DEFINE_integer("samples", 4, "conversations (multi-session histories)")
  flags.DEFINE_integer("tokens", 8000, "history length per sample (tokens, 5k-30k)")
  flags.DEFINE_integer("recall", 20, "utterance-recall questions per sample (real)")
  flags.DEFINE_integer("planted", 6, "planted facts + questions per sample (synthetic, <= 6)")
  flags.DEFINE_integer("seed", 0, "sampling seed")
  flags.DEFINE_string("tokenizer_model", "smollm2-135m", "whose tokenizer measures lengths")


def main(argv):
  del argv
  if not FLAGS.out:
    raise app.UsageError("give --out (the conversations JSON to write)")
  if FLAGS.samples < 1 or FLAGS.tokens < 100 or FLAGS.recall < 0 or FLAGS.planted < 0:
    raise app.UsageError("need --samples >= 1, --tokens >= 100, --recall / --planted >= 0")
  from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
  from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel
  try:
    with open(C.chitchat_path()) as f:
      dataset = json.load(f)
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from e
  tok = Tokenizer.load(presets.resolve(FLAGS.tokenizer_model))
  count = lambda s: len(tok.encode(s, add_bos=False))
  convs = C.build_from_chitchat(dataset, samples=FLAGS.samples, target_tokens=FLAGS.tokens,
                                count_tokens=count, recall=FLAGS.recall, planted=FLAGS.planted,
                                seed=FLAGS.seed)
  C.dump_locomo(convs, FLAGS.out)
  for c in convs:
    history = "\n\n".join(C.render_session(s) for s in c.sessions)
    n_syn = sum(q.synthetic for q in c.qa)
    print(f"{c.sample_id}: {len(c.sessions)} sessions, {len(c.turns())} turns, "
          f"{count(history)} tokens, {len(c.qa) - n_syn} recall + {n_syn} planted questions")
  print(f"wrote {len(convs)} conversations to {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
