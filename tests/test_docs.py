"""The docs site builds strictly, and the README stays a short front page whose
links all land on real docs pages."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


def test_mkdocs_build_strict(tmp_path):
  """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a
  nav entry without a page fails the build (mkdocs.yml's validation block)."""
  pytest.importorskip("mkdocs")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                      "-d", str(tmp_path / "site")], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout + r.stderr
  assert (tmp_path / "site" / "index.html").is_file()
  assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def _links(text: str) -> list[str]:
  return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_readme_is_short_and_links_resolve():
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) < README_MAX_LINES
  links = [x for x in _links(text) if not re.match(r"^[a-z]+://", x)]
  assert links, "the README links to its docs pages"
  for link in links:
    path = link.split("#")[0]
    assert (ROOT / path).exists(), f"README links to a missing file: {link}"
  # every docs section the README points at is a page in the site's nav
  nav = (ROOT / "mkdocs.yml").read_text()
  for link in links:
    if link.startswith("docs/") and link.endswith(".md"):
      assert link.removeprefix("docs/") in nav, f"{link} is not in mkdocs.yml's nav"


def test_every_docs_page_is_in_the_nav():
  nav = (ROOT / "mkdocs.yml").read_text()
  pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
  assert [p for p in pages if p not in nav] == []
