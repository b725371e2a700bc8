r"""Builds SemShareKV prompt-pair files (JSONL, `jaxkv.data.semshare_pairs`) from the
real texts scripts/fetch_texts.py unpacks (never committed).

    python scripts/make_pairs.py --texts=data_local/texts --out=data_local/semshare_pairs.jsonl \
        [--sources=austen,docs] [--kinds=eliminate,replace] [--fracs=0.1,0.3,0.5,0.7,0.9] \
        [--lengths=1000,2000,4000] [--per=1] [--paraphrase=0 --model=smollm2-135m] [--seed=0] \
        [--id_prefix=]

Per source, length, kind and fraction, `--per` pairs: an excerpt of about
`length` tokens (a run of Austen paragraphs, or of Python-doc passages: a
multi-document prompt) is the target; the reference is the same excerpt with
that fraction of its sentences eliminated or replaced by sentences from
elsewhere in the source (section 5.4 / B.2). The instruction is a summary
request; for the docs, every pair also gets a question about one of its
passages (kept unchanged, as B.1 does for QA) with that passage's first
sentence as the answer. `--paraphrase=N` adds N pairs per source and length
whose reference rewrites a contiguous 30% of the sentences with the model
(greedy; kept when within 10% of the original token count, as B.1).
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

from jaxkv.data import semshare_pairs as SP
from jaxkv.data import texts

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("texts", "data_local/texts", "folder of scripts/fetch_texts.py")
  flags.DEFINE_string("out", None, "pairs JSONL to write")
  flags.DEFINE_list("sources", ["austen", "docs"], "austen and / or docs")
  flags.DEFINE_list("kinds", ["eliminate", "replace"], "eliminate and / or replace")
  flags.DEFINE_list("fracs", ["0.1", "0.3", "0.5", "0.7", "0.9"], "sentence fractions changed")
  flags.DEFINE_list("lengths", ["1000", "2000", "4000"], "target lengths (tokens)")
  flags.DEFINE_integer("per", 1, "pairs per source x length x kind x fraction")
  flags.DEFINE_integer("paraphrase", 0, "model-paraphrased pairs per source x length")
  flags.DEFINE_string("model", "smollm2-135m", "the paraphrasing model (preset or path)")
  flags.DEFINE_string("tokenizer_model", "smollm2-135m", "whose tokenizer measures lengths")
  flags.DEFINE_integer("seed", 0, "pair seed")
  flags.DEFINE_string("id_prefix", "", "prefix of every pair id (files built apart can be "
                      "concatenated without id clashes)")


def _sources(root: str) -> dict[str, list[str]]:
  out = {}
  if "austen" in FLAGS.sources:
    novels = texts.austen_paragraphs(os.path.join(root, texts.AUSTEN))
    out["austen"] = [p for name in sorted(novels) for p in novels[name]]
  if "docs" in FLAGS.sources:
    passages = texts.doc_passages(os.path.join(root, texts.PYTHON_DOCS))
    out["docs"] = [f"{p.title}\n{p.text}" for p in passages]
  unknown = set(FLAGS.sources) - {"austen", "docs"}
  if unknown:
    raise app.UsageError(f"unknown sources {sorted(unknown)}; known: austen, docs")
  return out


def _question(paras, rng):
  """(question, answer) about one passage of a docs excerpt: its title's subject
  and its first sentence."""
  i = int(rng.integers(len(paras)))
  title, first = paras[i][0].split("\n", 1)[0], paras[i][0].split("\n", 1)[-1]
  return f'What does the text above say "{title}" is about?', first


def main(argv):
  del argv
  if not FLAGS.out:
    raise app.UsageError("give --out (the pairs JSONL to write)")
  import jaxkv  # pylint: disable=import-outside-toplevel
  from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
  from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel
  try:
    sources = _sources(FLAGS.texts)
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from e
  tok = Tokenizer.load(presets.resolve(FLAGS.tokenizer_model))
  count = lambda s: len(tok.encode(s, add_bos=False))
  rng = np.random.default_rng(FLAGS.seed)
  llm = None
  pairs = []
  for src, blocks in sources.items():
    pool = [s for b in blocks[::7] for s in SP.sentences(b)]
    for length in (int(x) for x in FLAGS.lengths):
      jobs = [(k, float(f)) for k in FLAGS.kinds for f in FLAGS.fracs] * FLAGS.per
      jobs += [("paraphrase", 0.3)] * FLAGS.paraphrase
      for kind, frac in jobs:
        paras = SP.excerpt(blocks, count, length, rng)
        if kind == "eliminate":
          ref = SP.eliminate(paras, frac, rng)
        elif kind == "replace":
          ref = SP.replace(paras, frac, pool, rng)
        elif kind == "paraphrase":
          if llm is None:
            llm = jaxkv.load(FLAGS.model)
          rewrite = lambda s: llm.generate(
              [{"role": "user", "content": "Rewrite the following text in other words, "
                "keeping its meaning and length. Reply with the rewritten text only.\n\n" + s}],
              jaxkv.SamplingConfig(max_tokens=int(1.3 * count(s)) + 8))[0].text
          ref = SP.paraphrase(paras, frac, rewrite, count, rng)
          if ref is None:
            print(f"  {src} {length}: paraphrase off by > 10% in length, skipped")
            continue
        else:
          raise app.UsageError(f"unknown kind {kind!r}")
        meta = dict(source=src, kind=kind, frac=frac, length=length)
        base = f"{FLAGS.id_prefix}{src}/{length}/{kind}/{frac:g}/{len(pairs)}"
        pairs.append(SP.Pair(base, SP.join(ref), SP.join(paras), SP.SUMMARY, meta=meta))
        if src == "docs":
          q, a = _question(paras, rng)
          pairs.append(SP.Pair(base + "/qa", SP.join(ref), SP.join(paras), q, a, meta=meta))
      print(f"{src} {length}: {len(pairs)} pairs so far", flush=True)
  SP.dump_pairs(pairs, FLAGS.out)
  print(f"wrote {len(pairs)} pairs to {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
