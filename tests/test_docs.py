"""The documentation stays true to the repository: every relative link resolves (a `#anchor`
into a markdown file names one of its headings, by GitHub's slug rule), the README stays a
front door of at most 200 lines that links every page of docs/, and every `b12x` and `make`
command a page shows in a code block is one the CLI and the Makefile accept. The `b12x`
commands are parsed by the CLI's own click commands (`make_context`), nothing is run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from b12x_toolchain.exporter.cli.main import main as CLI
from paths import ROOT

README = ROOT / "README.md"
PAGES = sorted({README, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")})
README_MAX_LINES = 200


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ------------------------------------------------------------------ reading markdown

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def split_markdown(text: str) -> tuple[list[tuple[int, str]], list[list[tuple[int, str]]]]:
    """(prose lines, fenced code blocks), each line with its 1-based number."""
    prose, blocks, block, fence = [], [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if block is None and opened:
            block, fence = [], opened.group(1)
        elif block is not None and opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) \
                and not line.strip().strip(fence[0]):
            blocks.append(block)
            block = None
        elif block is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    assert block is None, "a code fence is never closed"
    return prose, blocks


def prose_text(text: str) -> str:
    """The page without its fenced blocks, line numbers kept (fenced lines left empty)."""
    lines = text.splitlines()
    _, blocks = split_markdown(text)
    for block in blocks:
        for number, _ in block:
            lines[number - 1] = ""
    for number, line in enumerate(lines):  # the fences themselves
        if FENCE.match(line):
            lines[number] = ""
    return "\n".join(lines)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, links and HTML reduced to their text,
    every character but letters, digits, `_`, `-` and spaces dropped, spaces made `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in split_markdown(path.read_text())[0]:
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = github_slug(heading.group(1))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link outside code, targets with a scheme left out."""
    text = prose_text(path.read_text())
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # code spans: blanked, lines kept
    found = []
    for pattern in (INLINE_LINK, REFERENCE_LINK):
        for match in pattern.finditer(text):
            target = match.group(1)
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                found.append((text.count("\n", 0, match.start()) + 1, target))
    return found


def code_spans(path: Path) -> list[tuple[int, str]]:
    text = prose_text(path.read_text())
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())) for m in CODE_SPAN.finditer(text)]


def code_lines(path: Path) -> list[tuple[int, str]]:
    """Every logical line of the page's fenced blocks: shell continuations joined."""
    out = []
    for block in split_markdown(path.read_text())[1]:
        pending, start = "", None
        for number, line in block:
            start = number if not pending else start
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
        if pending:
            out.append((start, pending))
    return out


# ------------------------------------------------------------------ links

@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    assert page.is_file(), f"{rel(page)} is missing"
    problems = []
    for line, target in links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        where = f"{rel(page)}:{line}: {target}"
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{where}: points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: {rel(resolved) if file_part else file_part} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading of {rel(resolved)} has the anchor #{anchor}")
    assert not problems, "\n".join(problems)


def test_the_pages_link_to_something():
    assert len(links(README)) >= len(list((ROOT / "docs").glob("*.md")))  # the extractor finds links at all


def test_github_slugs():
    assert github_slug("`b12x serve`: the OpenAI API") == "b12x-serve-the-openai-api"
    assert github_slug("`export.structural`") == "exportstructural"
    assert github_slug("Format 4.4 — the tokenizer") == "format-44--the-tokenizer"
    assert github_slug("GPU qualification: `gpu_check.py` and [x](y.md)") == "gpu-qualification-gpu_checkpy-and-x"


# ------------------------------------------------------------------ the README as a front door

def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    targets = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)}
    unlinked = [rel(p) for p in sorted((ROOT / "docs").rglob("*.md")) if p.resolve() not in targets]
    assert not unlinked, f"README.md links no page {unlinked}"
    blocks = ["\n".join(line for _, line in block).strip() for block in split_markdown(README.read_text())[1]]
    assert "make demo" in blocks and "make test" in blocks  # the newcomer's two commands, each a block of its own


# ------------------------------------------------------------------ `b12x` commands

COMMAND_LINE = re.compile(r"^\s*(?:\$\s+)?(?:[A-Za-z_]\w*=\S*\s+)*(?:\S*/)?b12x(?:\s|$)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"}
VARIABLE = re.compile(r"\$\{?[A-Za-z_]\w*\}?")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|<[^>]+>|\$\{?[A-Za-z_]\w*\}?)$")  # N, DIR, <path>, $VAR


def strip_comment(line: str) -> str:
    """The line up to a shell comment: a `#` outside quotes at a word's start."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def command_words(line: str) -> list[str]:
    """The arguments after `b12x` of a shown command line: prompt, environment prefix,
    comment and what follows a pipe or redirection dropped; `[--option VALUE]` and `...`
    (a usage line's optional parts) read as given and left out."""
    words = shlex.split(strip_comment(re.sub(r"^\s*\$\s+", "", line)))
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    assert words and (words[0] == "b12x" or words[0].endswith("/b12x")), line
    out = []
    for word in words[1:]:
        if word in SHELL_OPERATORS or word.startswith((">", "2>")):
            break
        word = word.lstrip("[").rstrip("]")
        if word and word not in ("...", "…"):
            out.append(word)
    return out


def dummy_value(param: click.Parameter, shown: str) -> str:
    """A value of the parameter's type standing in for a placeholder (N, DIR, $VAR)."""
    if isinstance(param.type, click.Choice):
        return str(param.type.choices[0])
    for candidate in ("1", "0.5", "0", VARIABLE.sub("x", shown) or "x"):
        try:
            param.type.convert(candidate, param, None)
            return candidate
        except click.BadParameter:
            continue
    return "x"


def parse_command(words: list[str]) -> None:
    """Parse `b12x WORDS` with the CLI's own commands; raise click's error if it would refuse them."""
    command, context, path = CLI, click.Context(CLI, info_name="b12x"), ["b12x"]
    while isinstance(command, click.Group):
        if not words or words[0].startswith("-"):
            raise click.UsageError(f"{' '.join(path)} needs a subcommand", context)
        name, words = words[0], words[1:]
        sub = command.get_command(context, name)
        if sub is None:
            raise click.UsageError(f"no such command: {' '.join(path)} {name}", context)
        path.append(name)
        if isinstance(sub, click.Group):
            context = click.Context(sub, info_name=name, parent=context)
        command = sub
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}
    positional = [p for p in command.params if isinstance(p, click.Argument)]
    args, i = [], 0
    while i < len(words):
        word = words[i]
        name, has_value, value = word.partition("=")
        if word.startswith("-") and len(word) > 1 and name in options:
            param = options[name]
            if param.is_flag or param.count:
                args.append(word)
            elif has_value:
                args.append(f"{name}={dummy_value(param, value) if PLACEHOLDER.match(value) else value}")
            elif i + 1 < len(words):
                i += 1
                args += [word, dummy_value(param, words[i]) if PLACEHOLDER.match(words[i]) else words[i]]
            else:
                args.append(word)  # click names the missing value
        elif word.startswith("-") and len(word) > 1:
            args.append(word)  # unknown: click refuses it by name
        else:
            taken = sum(1 for a in args if not a.startswith("-"))  # roughly which argument this is
            param = positional[min(taken, len(positional) - 1)] if positional else None
            args.append(dummy_value(param, word) if param is not None and PLACEHOLDER.match(word) else word)
        i += 1
    command.make_context(path[-1], args, parent=context)


@pytest.fixture
def cli_without_path_checks(monkeypatch):
    """The CLI with its paths' `exists=True` relaxed: a page shows packages a reader makes first."""
    def walk(command):
        for param in command.params:
            if isinstance(param.type, click.Path):
                monkeypatch.setattr(param.type, "exists", False)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)
    walk(CLI)


def shown_commands() -> list[tuple[str, str]]:
    return [(f"{rel(page)}:{number}", line) for page in PAGES if page.is_file()
            for number, line in code_lines(page) if COMMAND_LINE.match(line)]


def test_pages_show_b12x_commands():
    shown = {" ".join(command_words(line)[:1]) for _, line in shown_commands()}
    assert {"export", "run", "serve", "inspect"} <= shown, shown  # the extractor finds the commands at all


@pytest.mark.usefixtures("cli_without_path_checks")
def test_shown_b12x_commands_parse():
    problems = []
    for where, line in shown_commands():
        try:
            parse_command(command_words(line))
        except click.ClickException as error:
            problems.append(f"{where}: {' '.join(line.split())}\n    {error.format_message()}")
        except ValueError as error:  # shlex: unbalanced quotes
            problems.append(f"{where}: {line.strip()}\n    {error}")
    assert not problems, "\n".join(problems)


@pytest.mark.usefixtures("cli_without_path_checks")
@pytest.mark.parametrize("line, accepted", [
    ("b12x run out/x.b12x --prompt-ids 1,2,3 --slots N --threads $THREADS", True),
    ("$ B12X_API_KEY=k b12x serve PKG [--port 8000] [--prefix-cache-bytes N]   # a comment", True),
    ("b12x export --recipe dsv41 --weights WEIGHTS --jobs N | tee log", True),
    ("b12x abi diff A B", True),
    ("b12x exprot --recipe dsv41-tiny", False),  # no such command
    ("b12x abi compare A B", False),  # no such subcommand
    ("b12x run PKG --no-such-option", False),
    ("b12x run PKG --slots many", False),  # not a placeholder: a wrong value
    ("b12x inspect", False),  # the package is required
])
def test_the_command_check_refuses_what_the_cli_refuses(line, accepted):
    if accepted:
        parse_command(command_words(line))
    else:
        with pytest.raises(click.ClickException):
            parse_command(command_words(line))


# ------------------------------------------------------------------ `make` targets

def makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([^\s:=#$][^:=#]*?)\s*::?(?!=)", line)
        if rule:
            targets.update(t for t in rule.group(1).split() if not t.startswith("."))
    return targets


def shown_make_targets(page: Path) -> list[tuple[int, str]]:
    shown = [(n, line) for n, line in code_lines(page) if re.match(r"^\s*(?:\$\s+)?make(?:\s|$)", line)]
    shown += [(n, span) for n, span in code_spans(page) if re.match(r"^make(?:\s|$)", span)]
    out = []
    for number, text in shown:
        words = [w for w in shlex.split(strip_comment(re.sub(r"^\s*\$\s+", "", text)))[1:]
                 if not ENV_ASSIGNMENT.match(w)]
        out += [(number, w) for w in (words or [""]) if not w.startswith("-")]
    return out


def test_makefile_targets_are_read():
    assert {"setup", "demo", "test", "test-fast", "bench", "clean"} <= makefile_targets()


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_shown_make_targets_exist(page):
    targets = makefile_targets()
    unknown = [f"{rel(page)}:{n}: make {t or '(no target)'}" for n, t in shown_make_targets(page) if t not in targets]
    assert not unknown, "\n".join(unknown) + f"\nthe Makefile's targets: {sorted(targets)}"
