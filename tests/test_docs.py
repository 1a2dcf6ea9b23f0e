"""The README and docs/*.md stay true to the code: every `exlcli ...` command in their fenced code
blocks parses against the real command line (the command and subcommand exist, every option named
exists), and every relative link points to a file, and heading, that exists. No model is loaded."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest
import typer

from exlcli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
OPERATORS = {"|", "||", "&&", ";", "&"}
REDIRECTS = {">", ">>", "<", "<<", "2>", "&>", "2>&1"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def shell_lines(text: str):
    """(fence language, logical line) of every fenced shell block; backslash continuations joined."""
    for lang, body in FENCE.findall(text):
        if lang not in SHELL_BLOCKS:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.strip():
                yield line


def exlcli_commands(line: str) -> list[list[str]]:
    """The argument lists of the exlcli invocations in one shell line: the line is split at pipes,
    `&&` and `;`, environment assignments before a command and redirections are dropped, comments
    cut; `python3 -m exlcli` counts as `exlcli`. A line that is not shell (a transcript) gives none."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: prose or a transcript, not a command
        return []
    commands, current, skip = [], [], False
    for token in tokens + [";"]:
        if skip:
            skip = False
        elif token in OPERATORS:
            commands.append(current)
            current = []
        elif token in REDIRECTS:
            skip = token != "2>&1"
        else:
            current.append(token)
    found = []
    for words in commands:
        while words and ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words[:1] == ["exlcli"]:
            found.append(words[1:])
        elif words[:3] in (["python3", "-m", "exlcli"], ["python", "-m", "exlcli"]):
            found.append(words[3:])
    return found


@functools.cache
def root_command():
    return typer.main.get_command(app)


def parse_problem(args: list[str]) -> str | None:
    """None when `exlcli ARGS` parses: each group's options and the subcommand it names, then the
    command's own options and values (through its parse_args, as a real run does). Else what is
    wrong. Not click's resilient parsing: it swallows the very errors looked for (an unknown option)."""
    command = root_command()
    parent, name = None, "exlcli"
    while True:
        ctx = command.context_class(command, info_name=name, parent=parent)
        try:
            if hasattr(command, "commands"):  # a group: its options, then the subcommand's name
                _, rest, _ = command.make_parser(ctx).parse_args(args=list(args))
            else:
                command.parse_args(ctx, list(args))
                return None
        except Exception as e:  # click's NoSuchOption, BadOptionUsage, ...
            return f"{type(e).__name__}: {e}"
        if not rest:  # `exlcli --version`, or a group that runs without a subcommand (`exlcli bench`)
            return None
        sub = command.get_command(ctx, rest[0])
        if sub is None:
            return f"{name}: no such command {rest[0]!r}"
        parent, name, command, args = ctx, rest[0], sub, rest[1:]


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(f"{rel(page)}: {line.strip()}", args)
            for page in PAGES for line in shell_lines(page.read_text())
            for args in exlcli_commands(line)]


COMMANDS = documented_commands()


def test_the_docs_show_every_command():
    shown = {args[0] for _, args in COMMANDS if args}
    assert {"chat", "run", "batch", "serve", "bench", "perplexity", "pull", "ls", "info", "ps", "config"} <= shown
    assert len(COMMANDS) >= 60, "the command extraction found too few commands"


@pytest.mark.parametrize("where, args", COMMANDS, ids=[where[:90] for where, _ in COMMANDS])
def test_documented_command_parses(where, args):
    problem = parse_problem(args)
    assert problem is None, f"{where}\n  -> {problem}"


@pytest.mark.parametrize("line", [
    "exlcli run --no-such-flag 1 hello",
    "exlcli chat --temprature 0",
    "exlcli bench serve --concurency 4",
    "exlcli benchmark -p 512",
    "EXLCLI_CPU_THREADS=1 exlcli perplexity --chunk 8 file.txt",
    "printf 'x\\n' | exlcli chat --sead 1 > out.txt",
])
def test_a_wrong_command_is_caught(line):
    (args,) = exlcli_commands(line)
    assert parse_problem(args) is not None


def test_shell_syntax_around_a_command():
    assert exlcli_commands("printf 'a\\n/n 3 b\\n' | EXLCLI_CPU_THREADS=1 exlcli chat --seed 1 > answers.txt") == [
        ["chat", "--seed", "1"]]
    assert exlcli_commands("exlcli serve &  # in the background") == [["serve"]]
    assert exlcli_commands("python3 -m exlcli run -n 8 hi && exlcli ls") == [["run", "-n", "8", "hi"], ["ls"]]
    assert exlcli_commands(">>> What is the capital of France?") == []
    assert exlcli_commands("exlcli: fetching the default model ...") == []


def headings_of(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    text = FENCE.sub("", page.read_text())
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def relative_links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


LINKS = [(page, target) for page in PAGES for target in relative_links(page)]


def test_the_pages_link_to_each_other():
    assert len(LINKS) >= 30
    assert {target for page, target in LINKS if page.name == "README.md"} >= {
        "docs/benchmarks.md", "docs/architecture.md", "docs/kernels.md", "docs/configuration.md"}


@pytest.mark.parametrize("page, target", LINKS, ids=[f"{rel(p)}->{t}" for p, t in LINKS])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{rel(page)} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in headings_of(dest), f"{rel(page)} links to {target}: no such heading"
