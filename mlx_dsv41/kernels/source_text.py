"""The text of a kernel source as handed to MLX: comments, indentation and unused header items removed.

MLX builds a custom kernel's source string when the kernel is called and hashes all of it at every
launch, on both backends (CUDA: the JIT module's name; Metal: the library's name), so each byte of
header is host time per launch: ~0.2 µs per KB on the H200's host, and a decode step launches about
1,700 custom kernels (docs/design.md#kernel-source-size). A kernel includes whole helper headers
but uses a few of their items: `resolved` drops the conditional branches the backend header rules
out, then `pruned` keeps only the items the body reaches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/', re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_IDENT = re.compile(r"[A-Za-z_]\w*")
_DEFINE = re.compile(r"#\s*define\s+([A-Za-z_]\w*)")
_TEMPLATE = re.compile(r"^template\s*<")
# a tag's name, after any alignas(...) (a 16-byte aligned struct: hc.h's HcEight)
_TAGGED = re.compile(r"^(?:struct|class|union|enum(?:\s+class)?)\s+(?:alignas\s*\([^)]*\)\s*)?([A-Za-z_]\w*)")
_USING = re.compile(r"^using\s+([A-Za-z_]\w*)\s*=")


def minified(source: str) -> str:
    """C/C++/Metal source without comments, blank lines and leading indentation (string literals
    and line structure, which preprocessor continuations need, are kept)."""
    text = _TOKEN.sub(lambda m: m.group(0) if m.group(0).startswith('"') else "", source)
    lines = (line.strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


def _logical_lines(text: str) -> list[str]:
    """Lines with preprocessor continuations joined to their first line (by a newline)."""
    out: list[str] = []
    for line in text.splitlines():
        if out and out[-1].startswith("#") and out[-1].endswith("\\"):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out


_CONDITION = re.compile(r"^(!?)\s*(defined\s*\(\s*([A-Za-z_]\w*)\s*\)|([A-Za-z_]\w*))$")
_CONSTANT = re.compile(r"^#\s*define\s+([A-Za-z_]\w*)(?:\s+\(?\s*(-?\d+)\s*\)?)?\s*$")


@dataclass
class _Branch:
    decided: bool  # every condition so far known from the text itself
    emit: bool = True
    taken: bool = False


def resolved(header: str) -> str:
    """A minified header with each conditional whose condition the header itself decides (``NAME``,
    ``!NAME`` for a name #defined to an integer before it, ``defined(NAME)`` for a name #defined
    before it) replaced by its live branch. The backend headers define KX_HAS_MMA_F16,
    KX_HAS_ASYNC_COPY and KX_CUDA / KX_METAL, so each backend's source drops the other's code.
    Any other condition (``||``, a name defined elsewhere) stays for the compiler."""
    values: dict[str, int | None] = {}  # #defined names; the integer when it is one
    stack: list[_Branch] = []
    out: list[str] = []

    for line in _logical_lines(header):
        emitting = all(b.emit for b in stack)
        directive = re.match(r"#\s*(if|elif|else|endif)\b\s*(.*)", line)
        if directive is None:
            if emitting:
                out.append(line)
                m = _CONSTANT.match(line)
                if m and all(b.decided for b in stack):
                    values[m.group(1)] = None if m.group(2) is None else int(m.group(2))
                elif re.match(r"#\s*undef\s+(\w+)", line):
                    values.pop(line.split()[-1], None)
            continue
        kind, cond = directive.groups()
        if kind == "if":
            known = _decide(cond, values) if emitting else False
            stack.append(_Branch(known is not None, emit=known is not False, taken=known is True))
            if known is None and emitting:
                out.append(line)
            continue
        branch = stack[-1]
        outer = all(b.emit for b in stack[:-1])
        if kind == "endif":
            stack.pop()
            if not branch.decided and outer:
                out.append(line)
        elif not branch.decided:
            if outer:
                out.append(line)
        elif not outer:  # a chain inside a dropped branch: none of it is kept
            continue
        elif kind == "else":
            branch.emit, branch.taken = not branch.taken, True
        elif branch.taken:
            branch.emit = False
        else:  # an #elif after branches known to be dead
            known = _decide(cond, values)
            if known is None:  # the chain goes on for the compiler, from here
                out.append(f"#if {cond}")
                branch.decided, branch.emit = False, True
            else:
                branch.emit = branch.taken = known
    if stack:
        raise ValueError("kernel header has an #if without its #endif")
    return "".join(line + "\n" for line in out)


def _decide(cond: str, values: dict[str, int | None]) -> bool | None:
    """An #if condition's value from the names #defined so far (`values`), or None if the text
    does not decide it."""
    m = _CONDITION.match(cond.strip())
    if not m:
        return None
    negate, name = bool(m.group(1)), m.group(3) or m.group(4)
    if m.group(3):
        known = True if name in values else None
    else:
        known = None if values.get(name) is None else bool(values[name])
    return None if known is None else known != negate


@dataclass
class Item:
    """One top-level piece of a header: a preprocessor line (with its continuations) or one
    declaration. ``name`` is what it defines; None means it is always kept (conditionals,
    includes, anything whose name is not plain to see, such as an operator)."""

    text: str
    name: str | None


def _strip_template(decl: str) -> str:
    """decl without its leading ``template <...>`` clauses."""
    while _TEMPLATE.match(decl):
        decl = decl[_closing_angle(decl) + 1 :].lstrip()
    return decl


def _closing_angle(text: str) -> int:
    """Index of the '>' that closes text's first '<'."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == ">" and depth == 0:
            return i
    raise ValueError(f"kernel header: unclosed template clause in {text[:80]!r}")


def _declared_name(decl: str) -> str | None:
    """The name a C++ declaration at file scope defines, or None if it is not plain to see."""
    decl = _strip_template(_STRING.sub('""', decl))
    if decl.startswith("using namespace") or "operator" in _IDENT.findall(decl.split("{")[0]):
        return None
    for pattern in (_TAGGED, _USING):
        m = pattern.match(decl)
        if m:
            return m.group(1)
    if decl.startswith("typedef"):
        names = _IDENT.findall(decl.rstrip(";").split("[")[0])
        return names[-1] if names else None
    head = re.split(r"[{=;]", decl, maxsplit=1)[0]
    if "(" in head:  # a function: the identifier before its parameter list
        names = _IDENT.findall(head.split("(")[0])
    else:  # a variable, maybe an array
        names = _IDENT.findall(re.sub(r"\[.*?\]", "", head))
    return names[-1] if names else None


def _braces(line: str) -> int:
    line = _STRING.sub('""', line)
    return line.count("{") - line.count("}")


def items(header: str) -> list[Item]:
    """The top-level items of a minified header, in order."""
    out: list[Item] = []
    lines = header.splitlines()
    i, decl, depth = 0, [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not decl:
            block = [line]
            while block[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                block.append(lines[i])
            m = _DEFINE.match(line)
            out.append(Item("\n".join(block), m.group(1) if m else None))
        else:
            decl.append(line)
            depth += 0 if line.startswith("#") else _braces(line)
            if depth == 0 and line.endswith((";", "}")):
                text = "\n".join(decl)
                out.append(Item(text, _declared_name(" ".join(decl))))
                decl = []
        i += 1
    if decl:
        raise ValueError(f"kernel header ends inside a declaration: {' '.join(decl)[:120]!r}")
    return out


def pruned(header: str, body: str) -> str:
    """The items of ``header`` (minified) that ``body`` reaches through the names it uses, directly
    or through other kept items, in their order. Overloads and specializations share a name and are
    kept together; an item whose name is not plain to see is always kept, so a mistake here can
    only leave text in, or fail a compile (tests/test_kernel_sources.py compiles every kernel)."""
    parts = items(header)
    keep = [p.name is None for p in parts]
    seen = set(_IDENT.findall(body))
    for p, k in zip(parts, keep):
        if k:
            seen.update(_IDENT.findall(p.text))
    changed = True
    while changed:
        changed = False
        for j, p in enumerate(parts):
            if not keep[j] and p.name in seen:
                keep[j] = changed = True
                seen.update(_IDENT.findall(p.text))
    return "".join(p.text + "\n" for p, k in zip(parts, keep) if k)
