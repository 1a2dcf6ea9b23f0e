import json
from pathlib import Path

import pytest


def _write(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:  # a str is written as it is (for malformed lines), anything else as JSON
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture
def write_jsonl(tmp_path):
    def write(rows, name="in.jsonl"):
        return _write(tmp_path / name, rows)
    return write


@pytest.fixture
def read_jsonl():
    return _read
