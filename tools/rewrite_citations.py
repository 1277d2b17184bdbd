#!/usr/bin/env python3
"""Rewrite the code's citations of the external specs into citations of docs/.

The code used to cite specs that are not in the repository ("spec §4.2", "exl3 spec §3.3",
"mlx-notes §8.4", "(spec §4.3 "RoPE", pitfall §8.11)", a bare "§2.6" after another citation).
docs/ now states those facts; docs/citations.json maps every such citation to a section there.
This script rewrites each citation to its new form, the docs path and anchor:

    (spec §4.2)                          ->  (docs/model.md#mhc)
    (spec §4.3 "RoPE", pitfall §8.11)    ->  (docs/model.md#rope)          (duplicates merged)
    exl3 spec §3.3 steps 1-2             ->  docs/exl3.md#forward steps 1-2

    python tools/rewrite_citations.py            dry run: what would change; exit 1 if any
                                                 citation cannot be mapped
    python tools/rewrite_citations.py --list     every citation found and its target
    python tools/rewrite_citations.py --write    rewrite in place, then switch on the old-form
                                                 check of tests/test_doc_citations.py

Idempotent: a rewritten tree has no old citations left, so a second run changes nothing. A
citation it cannot map (no entry in docs/citations.json for its document and section) is
reported with its file and line and left as it is; --write then rewrites nothing at all.
After writing it lists changed lines over 100 characters and changed lines that still say
"spec" in prose, for a human to reflow or reword.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP_FILE = "docs/citations.json"
TEST_FILE = "tests/test_doc_citations.py"
SWITCH = "OLD_FORMS_REWRITTEN"
# Where citations are looked for (relative to the repository root): these folders recursively,
# plus README.md and every docs/*.md page.
SCOPE_DIRS = ("mlx_dsv41", "convert", "metal_ext", "benchmarks", "examples", "tests")
SCOPE_FILES = ("README.md",)
SCOPE_GLOBS = ("docs/*.md",)
EXCLUDE = (TEST_FILE,)
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".venv"}
# Any old-form citation: a section sign before a number, or "spec §" / "notes §".
OLD_FORM = re.compile(r"§\s*\d|(?:spec|notes)[ \t]*§")
# The new form: docs/<page>.md, optionally #<anchor>.
NEW_FORM = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?")
LONG_LINE = 100

_SECTION = r"\d+(?:\.\d+)*[a-z]?(?:-(?:\d+(?:\.\d+)*[a-z]?|[a-z]))?"
# Whitespace between a lead word and "§": blanks, or one line break with an optional comment leader.
_GAP = r"(?:[ \t]+|[ \t]*\n[ \t]*(?:(?:#|//)[ \t]*)?)"
# What may stand between two citations of one group ("§4.1, §4.2", "§4.3; roles §2.3").
_SEPARATOR = re.compile(r"[ \t]*(?:,|;|/|and|or)?[ \t]*(?:\n[ \t]*(?:(?:#|//)[ \t]*)?)?")


@dataclass
class Citation:
    path: str
    line: int
    start: int
    end: int
    text: str
    document: str | None
    keys: list[str]
    targets: list[str] = field(default_factory=list)
    problem: str | None = None
    gap: str = ""  # a line break kept from the lead's gap


def load_map(root: Path = ROOT) -> dict:
    return json.loads((root / MAP_FILE).read_text())


def _pattern(leads) -> re.Pattern:
    words = "|".join(re.escape(w) for w in sorted(leads, key=len, reverse=True))
    return re.compile(
        rf"(?P<lead>\b(?P<word>{words})(?P<gap>{_GAP}))?"
        rf"§(?P<sec>{_SECTION})"
        r"(?P<qual>[ \t]+(?:\"[^\"\n]+\"(?:,\s*\"[^\"\n]+\")*|[a-z]+\b))?"
    )


def scope_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for d in SCOPE_DIRS:
        for p in sorted((root / d).rglob("*")):
            if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts):
                files.append(p)
    files += [root / f for f in SCOPE_FILES if (root / f).is_file()]
    for g in SCOPE_GLOBS:
        files += sorted(root.glob(g))
    return [p for p in files if p.relative_to(root).as_posix() not in EXCLUDE]


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary or non-UTF-8 file."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _file_default(cmap: dict, rel: str) -> str:
    for rule in cmap["file_defaults"]:
        if fnmatch.fnmatch(rel, rule["glob"]):
            return rule["document"]
    return cmap["default_document"]


def _line_at(text: str, pos: int) -> tuple[int, str]:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text.count("\n", 0, pos) + 1, text[start : len(text) if end < 0 else end]


def find_citations(text: str, rel: str, cmap: dict) -> list[Citation]:
    """Every old-form citation in one file's text, resolved against the map."""
    sections, leads = cmap["sections"], cmap["leads"]
    default = _file_default(cmap, rel)
    overrides = [o for o in cmap["line_overrides"] if o["path"] == rel]
    found: list[Citation] = []
    prev_end, prev_doc = None, None
    for m in _pattern(leads).finditer(text):
        line_no, line = _line_at(text, m.start())
        word = m.group("word")
        grouped = prev_end is not None and _SEPARATOR.fullmatch(text[prev_end : m.start()]) is not None
        if word is not None and leads[word] is not None:
            doc = leads[word]
        elif word is None and grouped and prev_doc is not None:
            doc = prev_doc  # "§4.2" in "spec §4.1, §4.2"
        else:
            doc = next((o["document"] for o in overrides if "document" in o and o["line_contains"] in line),
                       default)
        sec = m.group("sec")
        qual = m.group("qual")
        end = m.end()
        keys = [f"{doc} §{sec}"]
        if qual:
            titles = re.findall(r"\"[^\"\n]+\"", qual)
            if titles:
                keys = [f"{doc} §{sec} {t}" for t in titles]
            elif f"{doc} §{sec} {qual.strip()}" in sections:
                keys = [f"{doc} §{sec} {qual.strip()}"]
            else:
                end = m.end("sec")  # an ordinary word after the citation: not part of it
        start = m.start()
        gap = m.group("gap") or ""
        kept_gap = ""
        if "\n" in gap:
            # "(spec\n# §3)": keep the line break; the bracket moves to the next line with the target.
            kept_gap = gap[gap.index("\n") :]
            opening = re.search(r"[ \t]*\($", text[:start])
            if opening:
                start, kept_gap = opening.start(), kept_gap + "("
        cit = Citation(rel, line_no, start, end, text[start:end], doc, keys, gap=kept_gap)
        for key in keys:
            target = sections.get(key)
            if target is None:
                cit.problem = f"no entry {key!r} in {MAP_FILE}"
                break
            cit.targets += [target] if isinstance(target, str) else list(target)
        retarget = [o for o in overrides if "target" in o and o["line_contains"] in line and o["section"] == sec]
        if retarget and not cit.problem:
            cit.targets = [retarget[0]["target"]]  # a more precise section for this one citation
        found.append(cit)
        prev_end, prev_doc = end, doc
    return found


def rewrite(text: str, citations: list[Citation]) -> str:
    """The text with every citation replaced by its docs targets; consecutive citations of one
    group keep their separators, and a target already given earlier in the group is not repeated."""
    out, pos, i = [], 0, 0
    while i < len(citations):
        group = [citations[i]]
        while i + 1 < len(citations) and _SEPARATOR.fullmatch(text[group[-1].end : citations[i + 1].start]):
            i += 1
            group.append(citations[i])
        i += 1
        out.append(text[pos : group[0].start])
        seen: list[str] = []
        for k, cit in enumerate(group):
            new = [t for t in dict.fromkeys(cit.targets) if t not in seen]
            if not new:
                continue  # e.g. "pitfall §8.11" after "§4.3 "RoPE"": both are docs/model.md#rope
            if seen:
                out.append(text[group[k - 1].end : cit.start])
            seen += new
            out.append(cit.gap + ", ".join(f"docs/{t}" for t in new))
        pos = group[-1].end
    out.append(text[pos:])
    return "".join(out)


def scan(root: Path = ROOT, cmap: dict | None = None) -> dict[str, tuple[str, list[Citation]]]:
    """rel path -> (text, citations) for every file in scope that has old-form citations."""
    cmap = cmap or load_map(root)
    result = {}
    for path in scope_files(root):
        text = read_text(path)
        if text is None or "§" not in text:
            continue
        rel = path.relative_to(root).as_posix()
        cits = find_citations(text, rel, cmap)
        if cits:
            result[rel] = (text, cits)
    return result


def old_forms(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, text) of every old-form citation left in scope."""
    left = []
    for path in scope_files(root):
        text = read_text(path)
        if text is None:
            continue
        for m in OLD_FORM.finditer(text):
            line_no, line = _line_at(text, m.start())
            left.append((path.relative_to(root).as_posix(), line_no, line.strip()))
    return left


def _changed_lines(old: str, new: str) -> list[tuple[int, str]]:
    """(line number, line) of the new text's lines that differ from the old text's (by position of
    the first difference onward within the changed region, good enough for a report)."""
    import difflib

    a, b = old.splitlines(), new.splitlines()
    changed = []
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            changed += [(j + 1, b[j]) for j in range(j1, j2)]
    return changed


def switch_on_test(root: Path) -> bool:
    path = root / TEST_FILE
    if not path.is_file():
        return False
    text = path.read_text()
    new = re.sub(rf"^{SWITCH} = False\b", f"{SWITCH} = True", text, count=1, flags=re.M)
    if new != text:
        path.write_text(new)
        return True
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    ap.add_argument("--write", action="store_true", help="rewrite the files in place")
    ap.add_argument("--list", action="store_true", help="list every citation and its target")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    found = scan(root)
    problems = [c for _, cits in found.values() for c in cits if c.problem]
    n = sum(len(cits) for _, cits in found.values())
    if args.list:
        for rel, (_, cits) in found.items():
            for c in cits:
                what = c.problem or ", ".join(f"docs/{t}" for t in c.targets)
                print(f"{rel}:{c.line}: {c.text!r} [{c.document}] -> {what}")
    for c in problems:
        print(f"UNMAPPED {c.path}:{c.line}: {c.text!r} read as {c.document!r}: {c.problem}", file=sys.stderr)
    print(f"{n} citations in {len(found)} files; {len(problems)} cannot be mapped")
    if problems:
        print("nothing rewritten: add the missing entries (or a line override) to docs/citations.json",
              file=sys.stderr)
        return 1
    reports = []
    for rel, (text, cits) in found.items():
        new = rewrite(text, cits)
        changed = _changed_lines(text, new)
        if not args.write and not args.list:
            for line_no, line in changed:
                print(f"{rel}:{line_no}: {line.strip()}")
        if args.write:
            (root / rel).write_text(new)
        reports += [(rel, ln, line) for ln, line in changed]
    if not args.write:
        return 0
    left = old_forms(root)
    for rel, line_no, line in left:
        print(f"LEFT {rel}:{line_no}: {line}", file=sys.stderr)
    if left:
        return 1
    print(f"rewrote {n} citations in {len(found)} files")
    if switch_on_test(root):
        print(f"{TEST_FILE}: {SWITCH} = True (the old-form check now runs)")
    for rel, line_no, line in reports:
        if len(line) > LONG_LINE:
            print(f"reflow {rel}:{line_no}: {len(line)} characters")
    for rel, line_no, line in reports:
        if re.search(r"\bspec\b", line, re.I):
            print(f"reword {rel}:{line_no}: {line.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
