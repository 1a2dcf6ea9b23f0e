"""exlcli/environment.py is the one list of EXLCLI_* variables: the code names no other,
docs/configuration.md shows exactly its table, and the accessors refuse names and kinds it does not list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exlcli import environment

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"EXLCLI_[A-Z0-9_]*[A-Z0-9]")


def test_every_variable_named_in_the_code_is_in_the_table():
    named = set()
    for path in (ROOT / "exlcli").rglob("*"):
        if path.suffix in (".py", ".c", ".h", ".cu", ".cuh", ".cpp") and path.name != "environment.py":
            named |= set(NAME.findall(path.read_text()))
    assert named - set(environment.VARIABLES) == set(), "named in the code but not in exlcli/environment.py"
    assert set(environment.VARIABLES) - named == set(), "listed in exlcli/environment.py but read nowhere"


def test_the_configuration_page_shows_the_table():
    page = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = "<!-- environment table: python3 -m exlcli.environment -->", "<!-- end of environment table -->"
    assert begin in page and end in page, "docs/configuration.md lost the markers around the variables table"
    shown = page.split(begin, 1)[1].split(end, 1)[0].strip()
    assert shown == environment.markdown_table()


def test_the_docs_name_only_listed_variables():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert set(NAME.findall(path.read_text())) <= set(environment.VARIABLES), path.name


def test_accessors(monkeypatch):
    monkeypatch.setenv("EXLCLI_NO_KERNELS", "1")
    assert environment.flag("EXLCLI_NO_KERNELS")
    monkeypatch.setenv("EXLCLI_NO_KERNELS", "yes")
    assert not environment.flag("EXLCLI_NO_KERNELS")
    monkeypatch.setenv("EXLCLI_CPU_THREADS", "3")
    assert environment.number("EXLCLI_CPU_THREADS") == 3
    monkeypatch.setenv("EXLCLI_CPU_THREADS", "three")
    with pytest.raises(ValueError, match="EXLCLI_CPU_THREADS"):
        environment.number("EXLCLI_CPU_THREADS")
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)
    assert environment.text("EXLCLI_MODEL") is None
    with pytest.raises(KeyError, match="EXLCLI_NO_KERNEL "):
        environment.flag("EXLCLI_NO_KERNEL")
    with pytest.raises(TypeError):
        environment.text("EXLCLI_NO_KERNELS")
