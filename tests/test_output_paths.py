"""Every writer goes through mixbits.atomic: symlinks are written through
(the link stays, its target gets the content), anything that is not a
regular file is refused, and unwritable places give one clear error."""

import json
import os
import socket

import pytest

from mixbits.atomic import write_json_atomic
from mixbits.cli import main
from mixbits.errors import MixbitsError, OutputPathError


def test_symlink_is_written_through(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json_atomic({"a": 1}, link)
    assert link.is_symlink(), "the link must survive"
    assert json.loads(target.read_text()) == {"a": 1}


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "new.json")
    write_json_atomic([1], link)
    assert link.is_symlink() and json.loads((tmp_path / "new.json").read_text()) == [1]


def test_fifo_and_socket_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputPathError, match="not a regular file"):
        write_json_atomic({}, fifo)
    assert fifo.exists() and not fifo.is_file()
    sock_path = tmp_path / "s"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(sock_path))
        with pytest.raises(OutputPathError, match="not a regular file"):
            write_json_atomic({}, sock_path)
    finally:
        s.close()


def test_symlink_to_a_device_is_refused(tmp_path):
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    with pytest.raises(OutputPathError, match="not a regular file"):
        write_json_atomic({}, link)
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_directory_and_file_parent_are_refused(tmp_path):
    with pytest.raises(OutputPathError, match="is a directory"):
        write_json_atomic({}, tmp_path)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputPathError, match="not a folder"):
        write_json_atomic({}, f / "out.json")
    assert isinstance(OutputPathError("x"), (MixbitsError, OSError))


def test_unwritable_folder():
    # sysfs refuses new files even to root, so this runs under any user.
    with pytest.raises(OutputPathError, match="Permission denied"):
        write_json_atomic({}, "/sys/mixbits-test.json")


def _table_json(tmp_path):
    from test_cli_errors import tiny_table

    p = tmp_path / "table.json"
    p.write_text(json.dumps(tiny_table()))
    return p


def test_cli_out_directory_is_one_line(tmp_path, capsys):
    table = _table_json(tmp_path)
    rc = main(["allocate", str(table), "--bpw", "4", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "is a directory" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
