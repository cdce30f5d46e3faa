"""The upload rules, fed as the bytes of an upload arrive: purpose, size, and a
batch file's JSON Lines with the first bad line named by its number."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conveyor.errors import InvalidRequest, RequestTooLarge
from conveyor.files.local import LocalFileStore
from conveyor.settings import Settings, load_settings
from gateway.files.uploads import UploadCheck, check_purpose, checked

SETTINGS = load_settings(max_file_bytes=1000, batch_max_lines=3)


def run(data: bytes, chunk: int = 7, settings: Settings = SETTINGS) -> UploadCheck:
    check = UploadCheck(settings.jobs)
    for start in range(0, len(data), chunk):
        check.feed(data[start:start + chunk])
    check.finish()
    return check


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_good_lines_pass_however_they_are_cut(chunk: int) -> None:
    data = '\n{"a": 1}\r\n\n  {"b": "é…"}  \n{"c": [1, {"d": null}]}'.encode()
    check = run(data, chunk)
    assert (check.requests, check.line_number, check.size) == (3, 5, len(data))


@pytest.mark.parametrize(("data", "message"), [
    (b'{"a": 1}\n\n[1, 2]\n', "Line 3 of the file is not a JSON object."),
    (b'{"a": 1}\n"text"\n', "Line 2 of the file is not a JSON object."),
    (b'{"a": 1}\n{"b": \n', "Line 2 of the file is not valid JSON"),
    (b'{"a": 1}\n{"b": 2}\n{"c": 3', "Line 3 of the file is not valid JSON"),
    (b'{"a": "\xff"}\n', "Line 1 of the file is not UTF-8 text."),
    (b'\n\n{"a": "\xe2\x82"}', "Line 3 of the file is not UTF-8 text."),
    (b"{'a': 1}\n", "Line 1 of the file is not valid JSON"),
])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_the_first_bad_line_is_named(data: bytes, message: str, chunk: int) -> None:
    with pytest.raises(InvalidRequest) as caught:
        run(data, chunk)
    assert caught.value.message.startswith(message) and caught.value.param == "file"
    assert caught.value.status == 400


def test_more_requests_than_a_batch_holds_are_refused() -> None:
    run(b'{"a": 1}\n\n\n{"a": 2}\n{"a": 3}\n\n')
    with pytest.raises(InvalidRequest, match=r"more than 3 requests \(line 4\)"):
        run(b'{"a": 1}\n{"a": 2}\n{"a": 3}\n{"a": 4}\n')


def test_a_file_may_fill_the_limit_but_not_pass_it() -> None:
    line = b'{"p": "' + b"x" * 90 + b'"}\n'  # 100 bytes
    at_limit = line * 3 + b" " * 700
    assert run(at_limit).size == 1000
    with pytest.raises(RequestTooLarge) as caught:
        run(at_limit + b" ")
    assert caught.value.status == 413 and caught.value.code == "request_too_large"


@pytest.mark.parametrize("data", [b"", b"\n\n  \r\n"])
def test_a_file_without_requests_is_refused(data: bytes) -> None:
    with pytest.raises(InvalidRequest, match="empty|no requests"):
        run(data)


@pytest.mark.parametrize("purpose", [None, "", "fine-tune", "assistants", "user_data",
                                     "batch_output", "vision", 5])
def test_only_batch_files_are_uploaded(purpose: object) -> None:
    assert check_purpose("batch") == "batch"
    with pytest.raises(InvalidRequest) as caught:
        check_purpose(purpose)
    assert caught.value.param == "purpose"


async def test_a_refused_upload_leaves_nothing_in_the_store(tmp_path: Path) -> None:
    store = LocalFileStore(load_settings(files_dir=tmp_path, max_file_bytes=1000).jobs)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"a": 1}\n{"b": 2}\n'
        yield b"oops\n"
        yield b'{"c": 3}\n'

    check = UploadCheck(store.jobs)
    with pytest.raises(InvalidRequest, match="Line 3"):
        await store.create("acme", "batch", "in.jsonl", checked(body(), check))
    assert list(store.tenant_dir("acme").iterdir()) == []

    good = UploadCheck(store.jobs)
    created = await store.create("acme", "batch", "in.jsonl",
                                 checked(_once(b'{"a": 1}\n'), good))
    assert await store.read("acme", created.id) == b'{"a": 1}\n'


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_a_line_nested_past_the_json_parser_is_a_400_naming_it() -> None:
    data = b'{"a": 1}\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n"
    with pytest.raises(InvalidRequest) as info:
        run(data, chunk=4096, settings=load_settings(max_file_bytes=1_000_000, batch_max_lines=3))
    assert "Line 2" in str(info.value) and info.value.param == "file"
