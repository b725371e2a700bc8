"""Real text corpora fetched from the Debian archive (docs/data.md), for reuse and
long-context workloads: never committed, fetched once into data_local/.

- `fetch_debian(package, dest)`: `apt-get download` + `dpkg-deb -x` into
  dest/<package>/ (idempotent; a clear error where apt is missing).
- Python 3.11 documentation (`python3.11-doc`, PSF license): the reST sources
  under usr/share/doc/python3.11/html/_sources. `doc_passages` reads each
  document's title and its introductory prose (the paragraphs before the first
  code block, directive or subsection), with reST roles and links reduced to
  their text: one passage per document, the retrieval unit of seed 002's
  workload (b).
- Jane Austen's six novels (`r-cran-janeaustenr`, public domain): R data
  files (each .rdb entry a 4-byte length + zlib-compressed R serialization,
  indexed by the .rdx), read with `rdata`; `austen_paragraphs` gives each
  novel's paragraphs (blank-line separated, chapter headings dropped).

    python scripts/fetch_texts.py --out=data_local/texts
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import struct
import subprocess
import tempfile
import warnings
import zlib

PYTHON_DOCS = "python3.11-doc"
AUSTEN = "r-cran-janeaustenr"
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data"
DOC_SOURCES = "usr/share/doc/python3.11/html/_sources"
FETCH_HINT = "python scripts/fetch_texts.py --out=data_local/texts"

_ROLE = re.compile(r":[\w:+-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")     # :mod:`json`, :func:`x <y>`
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")                     # `text <url>`_
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"\*\*?([^*]+)\*\*?")
_FOOT = re.compile(r"\s*\[#[^\]]*\]_")
_BULLET = re.compile(r"^(?:[*+-]|#\.|\d+\.)\s")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+]{3,})\s*$")


@dataclasses.dataclass(frozen=True)
class Passage:
  doc: str       # source document, relative to the sources root (e.g. "library/json")
  title: str     # the document's title, reST stripped
  text: str      # its introductory prose, reST stripped


def fetch_debian(package: str, dest: str | pathlib.Path) -> pathlib.Path:
  """Unpacks Debian `package` into dest/package (once) and returns that folder."""
  out = pathlib.Path(dest) / package
  if (out / ".complete").exists():
    return out
  if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
    raise RuntimeError(f"fetching {package} needs apt-get and dpkg-deb (a Debian machine); "
                       f"unpack the package into {out} by other means")
  with tempfile.TemporaryDirectory() as tmp:
    run = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True,
                         text=True)
    debs = list(pathlib.Path(tmp).glob(f"{package}_*.deb"))
    if run.returncode != 0 or not debs:
      raise RuntimeError(f"apt-get download {package} failed: {run.stderr.strip()[-400:]}")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(out)], check=True)
  (out / ".complete").write_text(debs[0].name + "\n")
  return out


def plain(rst: str) -> str:
  """reST inline markup reduced to its text, whitespace folded."""
  s = _LINK.sub(r"\1", rst)
  s = _ROLE.sub(lambda m: m.group(1).strip(), s)
  s = _LITERAL.sub(r"\1", s)
  s = _FOOT.sub("", s)
  s = _EMPH.sub(r"\1", s)
  return re.sub(r"\s+", " ", s).strip()


def intro(rst: str, max_chars: int = 1200) -> tuple[str, str] | None:
  """(title, introductory prose) of one reST document, or None when it has no
  title or no prose paragraph before its first code block / directive / section."""
  lines = rst.splitlines()
  title, i = None, 0
  while i + 1 < len(lines):
    if lines[i].strip() and _UNDERLINE.match(lines[i + 1]) and not _UNDERLINE.match(lines[i]):
      title, i = plain(lines[i]), i + 2
      break
    i += 1
  if not title:
    return None
  paras, cur = [], []
  for line in lines[i:] + [""]:
    if _UNDERLINE.match(line) and cur:           # the next section's title line: stop
      cur = cur[:-1]
      break
    if not line.strip():
      if cur:
        paras.append(" ".join(cur))
        cur = []
      continue
    if line.startswith((" ", "\t")):               # indented: a directive's body or code
      continue
    if line.startswith(".."):                      # directive / comment / target
      continue
    if _BULLET.match(line):                        # a list: the intro ends before it
      break
    cur.append(line.strip())
  if cur:
    paras.append(" ".join(cur))
  prose = []
  for p in paras:
    if p.startswith(("**Source code:**", "---")) or set(p) <= set("-=~ "):
      continue
    if p.endswith("::"):                           # a code block follows: the intro ends
      prose.append(p[:-1].rstrip(":") + ".")
      break
    prose.append(p)
    if sum(len(x) for x in prose) >= max_chars:
      break
  text = plain(" ".join(prose))[:max_chars]
  return (title, text) if len(text) >= 80 else None


def doc_passages(root: str | pathlib.Path, sections: tuple[str, ...] = ("library",),
                 min_chars: int = 200) -> list[Passage]:
  """One passage per document of the Python docs under `root` (the folder
  `fetch_debian` made, or the _sources folder itself), from the listed
  top-level sections, sorted by document name."""
  root = pathlib.Path(root)
  src = root / DOC_SOURCES if (root / DOC_SOURCES).exists() else root
  if not src.is_dir():
    raise FileNotFoundError(f"no Python documentation sources under {root}; run {FETCH_HINT}")
  out = []
  for sec in sections:
    for f in sorted((src / sec).rglob("*.rst.txt")):
      got = intro(f.read_text(errors="replace"))
      if got and len(got[1]) >= min_chars:
        out.append(Passage(doc=str(f.relative_to(src))[:-len(".rst.txt")], title=got[0],
                           text=got[1]))
  if not out:
    raise ValueError(f"no passages found under {src} (sections {sections})")
  return out


def austen_novels(root: str | pathlib.Path) -> dict[str, list[str]]:
  """{novel: its lines} from the unpacked r-cran-janeaustenr package under root."""
  import rdata  # pylint: disable=import-outside-toplevel  (bench extra)
  root = pathlib.Path(root)
  data = root / AUSTEN_DATA if (root / AUSTEN_DATA).exists() else root
  if not (data / "Rdata.rdx").is_file():
    raise FileNotFoundError(f"no janeaustenr data under {root}; run {FETCH_HINT}")
  index = rdata.read_rds(data / "Rdata.rdx")["variables"]
  raw = (data / "Rdata.rdb").read_bytes()
  out = {}
  for name, (offset, length) in index.items():
    blob = raw[int(offset):int(offset) + int(length)]
    size = struct.unpack(">I", blob[:4])[0]
    body = zlib.decompress(blob[4:])
    if len(body) != size:
      raise ValueError(f"janeaustenr entry {name}: {len(body)} bytes, header says {size}")
    with warnings.catch_warnings():       # "Unknown file type: assumed RDS": it is one
      warnings.simplefilter("ignore", UserWarning)
      lines = rdata.conversion.convert(rdata.parser.parse_data(body, expand_altrep=True))
    out[str(name)] = [str(x) for x in lines]
  return out


def austen_paragraphs(root: str | pathlib.Path, min_chars: int = 40) -> dict[str, list[str]]:
  """{novel: paragraphs}: blank-line separated lines joined, chapter / volume
  headings and short lines dropped."""
  out = {}
  for name, lines in austen_novels(root).items():
    paras, cur = [], []
    for line in lines + [""]:
      if line.strip():
        cur.append(line.strip())
        continue
      text = " ".join(cur)
      cur = []
      if len(text) >= min_chars and not re.match(r"^(CHAPTER|VOLUME|Chapter)\b", text):
        paras.append(text)
    out[name] = paras
  return out
