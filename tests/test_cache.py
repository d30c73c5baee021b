"""Source archives fetched from a package index's simple page: the sha256
the index lists is checked, and failures say what is missing."""

import hashlib

import pytest

from mixbits.models._cache import Unavailable, fetch_sdist


def _index(tmp_path, data: bytes, digest: str):
    (tmp_path / "files").mkdir()
    sdist = tmp_path / "files" / "pkg-1.0.tar.gz"
    sdist.write_bytes(data)
    page = tmp_path / "simple" / "pkg"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<a href="{sdist.as_uri()}#sha256={digest}">pkg-1.0.tar.gz</a>\n'
        f'<a href="{sdist.as_uri()}#sha256={"0" * 64}">pkg-0.9.tar.gz</a>\n')
    return (tmp_path / "simple").as_uri()


def test_fetch_sdist_checks_the_index_hash(tmp_path, monkeypatch):
    data = b"not really a tarball, but bytes with a hash"
    monkeypatch.setenv("PIP_INDEX_URL", _index(tmp_path, data, hashlib.sha256(data).hexdigest()))
    # file:// pages have no index.html fallback: point at the file itself
    monkeypatch.setattr("mixbits.models._cache._simple_page_url",
                        lambda index, name: f"{index}/{name}/index.html")
    out = fetch_sdist("pkg", "1.0", tmp_path / "dl")
    assert out.read_bytes() == data and out.name == "pkg-1.0.tar.gz"
    with pytest.raises(Unavailable, match="lists no pkg-2.0.tar.gz"):
        fetch_sdist("pkg", "2.0", tmp_path / "dl2")


def test_fetch_sdist_rejects_a_corrupt_download(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", _index(tmp_path, b"tampered", hashlib.sha256(b"original").hexdigest()))
    monkeypatch.setattr("mixbits.models._cache._simple_page_url",
                        lambda index, name: f"{index}/{name}/index.html")
    with pytest.raises(Unavailable, match="sha256 does not match"):
        fetch_sdist("pkg", "1.0", tmp_path / "dl")
    assert not (tmp_path / "dl" / "pkg-1.0.tar.gz").exists()


def test_fetch_sdist_unreachable_index(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "nowhere").as_uri())
    with pytest.raises(Unavailable, match="cannot download pkg-1.0.tar.gz"):
        fetch_sdist("pkg", "1.0", tmp_path / "dl")
