"""`exlcli ls` and `exlcli rm`: the cache folder's models by name; rm deletes exactly the one named
(and its unfinished download), never another nor anything outside the folder."""

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app


@pytest.fixture
def cache(tmp_path, monkeypatch, private_runtime_dir):
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    models = tmp_path / "cache" / "models"
    (models / ".downloads").mkdir(parents=True)
    (models / "tiny.gguf").write_bytes(b"x" * 2_000_000)
    (models / "tiny-other.gguf").write_bytes(b"y")
    (models / "folder").mkdir()
    (models / "folder" / "config.json").write_text("{}")
    (models / ".downloads" / "tiny-other.gguf.part").write_bytes(b"z")
    (models / ".downloads" / "tiny.gguf.part").write_bytes(b"z")
    (tmp_path / "outside.gguf").write_bytes(b"keep")
    return models


def test_ls_lists_models_and_not_unfinished_downloads(cache):
    result = CliRunner().invoke(app, ["ls"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "MODIFIED", "PATH"]
    assert [line.split()[0] for line in lines[1:]] == ["folder", "tiny-other.gguf", "tiny.gguf"]
    assert "2 MB" in lines[3] and ".part" not in result.stdout


def test_rm_deletes_only_the_named_model(cache):
    result = CliRunner().invoke(app, ["rm", "tiny"])
    assert result.exit_code == 0, result.output
    assert not (cache / "tiny.gguf").exists() and not (cache / ".downloads" / "tiny.gguf.part").exists()
    assert (cache / "tiny-other.gguf").exists() and (cache / ".downloads" / "tiny-other.gguf.part").exists()
    assert CliRunner().invoke(app, ["rm", "folder"]).exit_code == 0 and not (cache / "folder").exists()


@pytest.mark.parametrize("name, fragment", [
    ("nope", "no model 'nope' in"), ("../outside.gguf", "is not a model name"), ("..", "is not a model name"),
])
def test_rm_refuses_what_is_not_a_cached_model(cache, name, fragment):
    result = CliRunner().invoke(app, ["rm", name])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and fragment in result.stderr
    assert (cache.parent.parent / "outside.gguf").exists()


def test_rm_repack_cache_deletes_the_layout_files_alone(cache):
    repack = cache.parent / "repack"
    repack.mkdir()
    (repack / "a.bin").write_bytes(b"x" * 4096)
    (repack / "b.bin.123.ab.tmp").write_bytes(b"y")
    result = CliRunner().invoke(app, ["rm", "--repack-cache"])
    assert result.exit_code == 0, result.output
    assert "removed 2 repack cache files" in result.stderr
    assert not list(repack.iterdir()) and (cache / "tiny.gguf").exists()


def test_rm_without_a_name_or_the_flag_says_what_it_takes(cache):
    result = CliRunner().invoke(app, ["rm"])
    assert result.exit_code == 1 and "--repack-cache" in result.stderr
