"""Generated text on a terminal: control characters made visible, special tokens and reasoning dimmed.

A model (the demo's random one above all) can emit byte tokens such as ESC or BEL, which a terminal
would execute (move the cursor, clear the screen, ring), and control tokens such as `<｜User｜>`,
which look like text. On a terminal they are shown as `\\x1b` and dimmed; written to a pipe or a
file the text stays byte for byte what the model produced.
"""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, and C1 controls (ESC [ can also be spelled \x9b).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
DIM, RESET = "\x1b[2m", "\x1b[0m"


def visible(text: str) -> str:
    """`text` with every control character (except tab and newline) written as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def dim(text: str) -> str:
    return f"{DIM}{text}{RESET}" if text else ""


class TokenWriter:
    """Writes generated text to `stream`; on a terminal, control characters are escaped and the
    text of `special` token ids (and everything while `dimmed`) is dimmed."""

    def __init__(self, stream, special: set[int] = frozenset(), tty: bool | None = None):
        self.stream, self.special = stream, set(special)
        self.tty = stream.isatty() if tty is None else tty
        self.dimmed = False

    def write(self, text: str, token: int | None = None) -> None:
        if self.tty:
            text = visible(text)
            if self.dimmed or token in self.special:
                text = dim(text)
        self.stream.write(text)
        self.stream.flush()
