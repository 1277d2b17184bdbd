"""Citations in the code point into docs/, and every cited section exists.

The code cites facts as `docs/<page>.md#<anchor>`; each page marks its sections with explicit
anchors (`<a id="anchor"></a>` before the heading), which stay put when a title is reworded.
The specs the code once cited by section sign and number (spec, mlx-notes, a bare section
number after another citation) are not in the repository, so no such citation may come back.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ANCHOR = re.compile(r'<a id="([A-Za-z0-9_-]+)"></a>')
# A citation: docs/<page>.md, optionally #<anchor>.
CITATION = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?")
# A relative markdown link between pages: ](page.md#anchor).
MD_LINK = re.compile(r"\]\(([^)\s]+?\.md)(?:#([A-Za-z0-9_-]+))?\)")
# The old forms: a section sign before a number, or after "spec" or "notes". Spelled with \u00a7 so
# that this file does not match itself.
OLD_FORM = re.compile("\u00a7\\s*\\d|(?:spec|notes)[ \\t]*\u00a7")
# Folders never searched when git cannot list the tree (build outputs, environments, caches).
SKIP_PARTS = {".git", ".venv", "__pycache__", ".pytest_cache", "build", "dist", "gpu_out", ".gpu"}


def _tree_files() -> list[Path]:
    """Every file of the tree: git's tracked and untracked-but-not-ignored files, or, without
    git, a walk that skips build outputs and environments."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        files = [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [
            p
            for p in ROOT.rglob("*")
            if not SKIP_PARTS.intersection(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    return sorted(p for p in files if p.is_file())


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary or non-UTF-8 file."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _texts() -> dict[str, str]:
    texts = {}
    for path in _tree_files():
        text = _text(path)
        if text is not None:
            texts[path.relative_to(ROOT).as_posix()] = text
    return texts


def _anchors(page: Path) -> list[str]:
    return ANCHOR.findall(page.read_text())


def _missing(page: Path, anchor: str | None) -> str | None:
    """None if the page (and the anchor in it) exist, else what is missing."""
    if not page.is_file():
        return f"no page {page.relative_to(ROOT)}"
    if anchor is not None and anchor not in _anchors(page):
        return f"no anchor #{anchor} in {page.relative_to(ROOT)}"
    return None


def test_anchors_are_unique_per_page():
    for page in sorted(DOCS.glob("*.md")):
        ids = _anchors(page)
        dupes = sorted({a for a in ids if ids.count(a) > 1})
        assert not dupes, f"{page.name}: anchors defined twice: {dupes}"


def test_code_cites_docs():
    """The code, kernel sources, README and docs cite docs/ (a guard against this test scanning
    nothing: the citations are there to check)."""
    texts = _texts()
    cited = {rel for rel, text in texts.items() if CITATION.search(text)}
    for folder in ("mlx_dsv41/", "docs/"):
        assert any(rel.startswith(folder) for rel in cited), f"no citation found under {folder}"
    assert any(rel.endswith((".metal", ".h")) for rel in cited), "no citation in a kernel source"


def test_citations_resolve():
    """Every `docs/<page>.md#<anchor>` anywhere in the tree names a page and an explicit anchor
    in it, and every relative .md link of a markdown file exists."""
    missing = []
    for rel, text in _texts().items():
        for m in CITATION.finditer(text):
            problem = _missing(DOCS / m.group(1), m.group(2))
            if problem:
                missing.append(f"{rel}: {m.group(0)}: {problem}")
        if rel.endswith(".md"):
            for m in MD_LINK.finditer(text):
                if "://" in m.group(1):
                    continue
                problem = _missing((ROOT / rel).parent.joinpath(m.group(1)).resolve(), m.group(2))
                if problem:
                    missing.append(f"{rel}: {m.group(0)}: {problem}")
    assert not missing, "\n".join(missing)


def test_no_old_form_citations_left():
    left = []
    for rel, text in _texts().items():
        for m in OLD_FORM.finditer(text):
            line_no = text.count("\n", 0, m.start()) + 1
            left.append(f"{rel}:{line_no}: {text.splitlines()[line_no - 1].strip()}")
    assert not left, "old-form citations (section sign and number) left:\n" + "\n".join(left)


def test_old_form_check_catches_each_form():
    """The old-form pattern matches what the code used to write, and not the new form."""
    for old in ("spec \u00a74.2", "mlx-notes \u00a78.4", "(see \u00a72.6)", "exl3 spec\u00a7 3"):
        assert OLD_FORM.search(old), old
    assert not OLD_FORM.search("docs/model.md#mhc")
