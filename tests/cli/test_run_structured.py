"""`exlcli run --json-schema FILE | --regex R | --grammar FILE`."""

import json
import re

import jsonschema
import pytest
import typer
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.cli.run import grammar_from_flags
from exlcli.engine.request import GrammarSpec


def test_flags_give_one_constraint(tmp_path, capsys):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.lark").write_text('start: "a" | "b"')
    assert grammar_from_flags(str(tmp_path / "s.json"), None, None) == GrammarSpec("json_schema", schema)
    assert grammar_from_flags(None, "[0-9]+", None) == GrammarSpec("regex", "[0-9]+")
    assert grammar_from_flags(None, None, str(tmp_path / "g.lark")) == GrammarSpec("grammar", 'start: "a" | "b"')
    assert grammar_from_flags(None, None, None) is None
    (tmp_path / "bad.json").write_text("{nope")
    for args, words in [((str(tmp_path / "s.json"), "x", None), "cannot be used together"),
                        ((str(tmp_path / "missing.json"), None, None), "cannot read"),
                        ((str(tmp_path / "bad.json"), None, None), "is not JSON")]:
        with pytest.raises(typer.Exit):
            grammar_from_flags(*args)
        assert words in capsys.readouterr().err


@pytest.mark.slow
def test_run_with_a_schema_and_a_regex_on_the_default_model(tmp_path, default_model_path, monkeypatch):
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    runner = CliRunner()
    out = runner.invoke(app, ["run", "-m", default_model_path, "--temperature", "0", "-n", "80",
                              "--json-schema", str(tmp_path / "s.json"), "Describe a person as JSON."])
    assert out.exit_code == 0, out.output
    jsonschema.validate(json.loads(out.stdout), schema)
    out = runner.invoke(app, ["run", "-m", default_model_path, "-n", "20", "--regex", "(yes|no)", "Is it?"])
    assert out.exit_code == 0 and re.fullmatch(r"(yes|no)\n", out.stdout), out.output
    (tmp_path / "bad.json").write_text('{"type": "objekt"}')
    out = runner.invoke(app, ["run", "-m", default_model_path, "--json-schema", str(tmp_path / "bad.json"), "x"])
    assert out.exit_code == 1 and "invalid JSON schema: Invalid type: objekt" in out.output
