r"""Fetches the real text corpora (docs/data.md) from the Debian archive (never committed).

    python scripts/fetch_texts.py [--out=data_local/texts] \
        [--packages=python3.11-doc,r-cran-janeaustenr]

Each package is downloaded with `apt-get download` and unpacked with `dpkg-deb -x`
into OUT/<package>/ (a rerun skips what is there). python3.11-doc (PSF license)
holds the Python documentation sources that `bench/reuse.py --workload=retrieval`
reads (`jaxkv.data.texts.doc_passages`); r-cran-janeaustenr (public domain) Jane
Austen's six novels (`jaxkv.data.texts.austen_paragraphs`), used with the docs by
scripts/make_pairs.py for SemShareKV's prompt pairs.
"""

from __future__ import annotations

from absl import app, flags

from jaxkv.data import texts

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", "data_local/texts", "folder the packages are unpacked into")
  flags.DEFINE_list("packages", [texts.PYTHON_DOCS, texts.AUSTEN], "Debian packages to fetch")


def main(argv):
  del argv
  for package in FLAGS.packages:
    try:
      path = texts.fetch_debian(package, FLAGS.out)
    except RuntimeError as e:
      raise app.UsageError(str(e)) from e
    print(f"{package}: {path}")
    if package == texts.PYTHON_DOCS:
      print(f"  {len(texts.doc_passages(path))} library passages")
    elif package == texts.AUSTEN:
      novels = texts.austen_paragraphs(path)
      print(f"  {len(novels)} novels, {sum(map(len, novels.values()))} paragraphs")


if __name__ == "__main__":
  define_flags()
  app.run(main)
