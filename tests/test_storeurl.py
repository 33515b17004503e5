"""A store URL parsed once: every spelling of one store has one identity,
different stores have different ones, and the display form holds no secret."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packcache._storeurl import parse_store_url, redact_text
from packcache.errors import RemoteError


@pytest.mark.parametrize(
    "spellings",
    [
        ["s3://bucket/p", "s3://AKIA:secret@bucket/p", "S3://BUCKET/p/", "s3a://bucket/p", "s3://bucket/./p",
         "s3://bucket/q/../p", "s3://bucket/p?X-Amz-Signature=x&token=y", "s3://bucket/p#frag", "s3://tok@bucket/p"],
        ["https://host.example/p", "https://user:pw@HOST.example:443/p/", "https://host.example/%70",
         "https://host.example/p?sig=abc"],
        ["http://127.0.0.1:8080/p", "http://u:p@127.0.0.1:8080/p//"],
        ["abfs://container@account.dfs.core.windows.net/p", "ABFS://container@Account.dfs.core.windows.net/p/"],
    ],
)  # fmt: skip
def test_every_spelling_of_one_store_has_one_identity(spellings: list[str]) -> None:
    identities = {parse_store_url(url).identity for url in spellings}
    assert len(identities) == 1, identities


def test_different_stores_have_different_identities(tmp_path: Path) -> None:
    urls = ["s3://bucket/p", "s3://bucket/q", "s3://other/p", "gs://bucket/p", "http://h/p", "https://h/p",
            "http://h:81/p", "abfs://c1@acct.dfs.core.windows.net/p", "abfs://c2@acct.dfs.core.windows.net/p",
            str(tmp_path / "a"), str(tmp_path / "b")]  # fmt: skip
    assert len({parse_store_url(url).identity for url in urls}) == len(urls)


def test_a_directory_store_is_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    same = [str(tmp_path / "s"), "s", "./s/", f"file://{tmp_path}/s", f"file://localhost{tmp_path}/s/",
            f"FILE://{tmp_path}//s", f"file://{tmp_path}/s?token=abc"]  # fmt: skip
    assert {parse_store_url(url).identity for url in same} == {f"file://{tmp_path}/s"}
    assert {parse_store_url(url).root for url in same} == {os.path.join(str(tmp_path), "s")}


@pytest.mark.parametrize(
    ("url", "named"),
    [("", "empty"), ("bogus://b/p", "unknown scheme"), ("file://host/dir", "no host"), ("file:rel", "absolute"),
     ("s3://b:99999/p", "port"), ("s3:///p", "no bucket"), ("https:///p", "no host"), ("s3://b/p\x00", "NUL"),
     ("bogus://u:hunter2pass@b/p?token=tokSECRET", "unknown scheme")],
)  # fmt: skip
def test_a_bad_url_is_a_value_error_that_shows_no_secret(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=named) as raised:
        parse_store_url(url)
    assert "hunter2pass" not in str(raised.value) and "tokSECRET" not in str(raised.value)


def test_the_display_form_and_every_message_hold_no_secret() -> None:
    url = parse_store_url("https://u:hunter2pass@Host:8443/p?X-Amz-Signature=sigSECRET&token=tokSECRET#frag")
    assert url.display == "https://host:8443/p" and str(url) == url.display and "hunter2pass" not in repr(url)
    assert url.scrub("GET https://u:hunter2pass@host:8443/p/k?token=tokSECRET failed; password: hunter2pass") == (
        "GET https://host:8443/p/k failed; password: ***"
    )
    error = RemoteError("remote_error", "at s3://k:hunter2pass@b/p?sig=sigSECRET", url="s3://k:hunter2pass@b/p?t=x")
    assert "hunter2pass" not in str(error) and "sigSECRET" not in str(error) and "hunter2pass" not in str(error.url)
    # An AWS secret key holds '/': typed raw into the URL, it must not show either.
    raw = "s3://AKIAEXAMPLE:wJalr/K7MDENG/bPxRfiCYsecret@bucket/p"
    with pytest.raises(ValueError) as raised:
        parse_store_url(raw)
    assert "K7MDENG" not in str(raised.value) and "bPxRfiCYsecret" not in str(raised.value), raised.value
    assert redact_text(f"at {raw}: failed") == "at s3://bucket/p: failed"
    assert redact_text("https://host:8443/a@b and https://host/models/v1@2024/x") == (
        "https://host:8443/a@b and https://host/models/v1@2024/x"
    )
    assert redact_text("see abfs://container@acct.dfs.core.windows.net/p?sv=x") == (
        "see abfs://container@acct.dfs.core.windows.net/p"
    )
