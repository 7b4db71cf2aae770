"""Size limits of the product code (the folders pyproject maps to the import root): no file over
MAX_FILE_LINES lines, and no function over MAX_FUNCTION_LINES, counted from its `def` line to its
last line (methods and nested functions included, decorators not). A file or function that must be
longer is listed in EXCEPTIONS with the reason; an entry that fits again is flagged, so the list
only ever names what still needs it."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from paths import ROOT

FOLDERS = ("exporter", "passes", "runtime", "b12x-toolchain")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60
# "path" (a file, from the repository root) or "path:name" (a function; a method or nested function
# by its dotted path, as in "runtime/x.py:Class.method") -> why it must be longer than its limit.
EXCEPTIONS: dict[str, str] = {}


def functions(tree: ast.AST, prefix: str = ""):
    """(dotted name, node) of every function in `tree`: module level, in classes, nested."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, f"{name}.")
        else:  # a def under an if, try or with is still the module's (or class's)
            yield from functions(node, prefix)


def over_limits(path: Path, label: str) -> dict[str, int]:
    """What of the file at `path` is over its limit: `label` for the file itself and
    `label:name` for each function, with its length in lines."""
    text = path.read_text()
    found = {}
    if (lines := len(text.splitlines())) > MAX_FILE_LINES:
        found[label] = lines
    for name, node in functions(ast.parse(text, filename=str(path))):
        if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
            found[f"{label}:{name}"] = length
    return found


def product_files() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


@functools.cache
def over_limits_in_product() -> dict[str, int]:
    found = {}
    for path in product_files():
        found.update(over_limits(path, path.relative_to(ROOT).as_posix()))
    return found


def test_no_file_or_function_is_over_its_limit():
    over = {label: lines for label, lines in over_limits_in_product().items() if label not in EXCEPTIONS}
    assert not over, (f"over the limits ({MAX_FILE_LINES} lines a file, {MAX_FUNCTION_LINES} a function): split "
                      f"them, or list them in EXCEPTIONS with the reason\n"
                      + "\n".join(f"  {label}: {lines} lines" for label, lines in sorted(over.items())))


def test_every_exception_is_still_over_its_limit():
    fitting = sorted(set(EXCEPTIONS) - set(over_limits_in_product()))
    assert not fitting, f"EXCEPTIONS entries that fit their limit now (or name nothing): {fitting}"
    assert all(reason.strip() for reason in EXCEPTIONS.values()), "every exception says why"


def test_every_product_folder_is_walked():
    # Guards against a walk that finds nothing and so passes.
    labels = {path.relative_to(ROOT).as_posix() for path in product_files()}
    assert {"runtime/prefix/l2.py", "exporter/train/pipeline.py", "b12x-toolchain/__init__.py"} <= labels
    assert all(any(label.startswith(f"{folder}/") for label in labels) for folder in FOLDERS)


def test_the_checker_flags_what_is_over_and_passes_what_is_at_the_limit(tmp_path):
    def body(lines: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))

    source = (f"def at_limit():\n{body(MAX_FUNCTION_LINES - 1, '    ')}"
              f"\n\nclass Holder:\n    @staticmethod\n    async def over():\n{body(MAX_FUNCTION_LINES, '        ')}"
              f"\n\ndef outer():\n    def inner():\n{body(MAX_FUNCTION_LINES, '        ')}    return inner\n")
    module = tmp_path / "module.py"
    module.write_text(source)
    # outer holds inner: both are over.
    assert over_limits(module, "module.py") == {"module.py:Holder.over": MAX_FUNCTION_LINES + 1,
                                                "module.py:outer": MAX_FUNCTION_LINES + 3,
                                                "module.py:outer.inner": MAX_FUNCTION_LINES + 1}
    module.write_text(body(MAX_FILE_LINES, ""))
    assert over_limits(module, "module.py") == {}
    module.write_text(body(MAX_FILE_LINES + 1, ""))
    assert over_limits(module, "module.py") == {"module.py": MAX_FILE_LINES + 1}
