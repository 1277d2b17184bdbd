"""No function in mlx_dsv41/ is over MAX_LINES lines (decorators and signature included) unless
the line directly above it gives the reason, as `# long: <why>`."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_dsv41"
MAX_LINES = 60


def _long_functions_without_reason(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function over MAX_LINES lines without a reason."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            above = lines[first - 2].strip() if first >= 2 else ""
            if length > MAX_LINES and not (above.startswith("# long:") and above[len("# long:") :].strip()):
                found.append((node.name, first, length))
    return found


def test_functions_are_short_or_say_why():
    problems = [
        f"{path.relative_to(PACKAGE.parent)}:{first}: {name} is {length} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, first, length in _long_functions_without_reason(path.read_text())
    ]
    assert not problems, f"functions over {MAX_LINES} lines without a `# long: <why>` line above:\n" + "\n".join(
        problems
    )


def test_the_check_sees_a_long_function_and_its_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    long_def = "def f():\n" + body
    assert _long_functions_without_reason(long_def) == [("f", 1, MAX_LINES + 1)]
    assert _long_functions_without_reason("# long: a table\n" + long_def) == []
    assert _long_functions_without_reason("# long:\n" + long_def) != []  # a reason must be given
    assert (
        _long_functions_without_reason("def f():\n" + body[: -len(f"    x{MAX_LINES - 1} = {MAX_LINES - 1}\n")]) == []
    )
