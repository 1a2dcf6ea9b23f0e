"""The runtime file's temporary copy is a new file of our own: never a planted link or an old file."""

import os
import stat

from exlcli.client import runtime_file
from exlcli.client.runtime_file import ServerRecord, read_record, write_record


def test_a_link_planted_at_the_temporary_name_is_not_followed(private_runtime_dir, tmp_path):
    runtime_file.secure_runtime_dir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    planted = private_runtime_dir / f".{runtime_file.FILE_NAME}.{os.getpid()}"  # the name a pid alone would give
    planted.symlink_to(victim)
    write_record(ServerRecord(url="http://127.0.0.1:1", pid=os.getpid(), model="m"))
    assert victim.read_text() == "keep me\n"
    assert read_record().url == "http://127.0.0.1:1"
    assert stat.S_IMODE(runtime_file.runtime_path().stat().st_mode) == 0o600


def test_the_temporary_file_is_opened_exclusive_without_following_links(private_runtime_dir, monkeypatch):
    opened = []
    real_open = os.open

    def spy(path, flags, mode=0o777, **kwargs):
        if str(path).startswith(str(private_runtime_dir)):
            opened.append((flags, mode))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(runtime_file.os, "open", spy)
    write_record(ServerRecord(url="http://127.0.0.1:2", pid=os.getpid(), model="m"))
    assert opened, "the record was not written through os.open"
    for flags, mode in opened:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and flags & os.O_CREAT and mode == 0o600
    assert [p.name for p in private_runtime_dir.iterdir()] == [runtime_file.FILE_NAME]  # no temporary left
