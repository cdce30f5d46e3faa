"""LocalFileStore on a real directory: round trips, the atomic create (leftovers
of a crash are never seen, a failed upload leaves nothing), ids checked before
they reach a path, tenants that cannot see each other's files, the order and
pages of a listing, and deletion."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conveyor.errors import InvalidRequest
from conveyor.files.local import LocalFileStore
from conveyor.files.store import (
    CHUNK_BYTES,
    FileNotFound,
    FilePurpose,
    new_file_id,
)
from conveyor.settings import load_settings

LINES = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'


def make_store(tmp_path: Path) -> LocalFileStore:
    return LocalFileStore(load_settings(files_dir=tmp_path / "files").jobs)


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


def visible_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


async def test_the_local_store_is_a_file_store(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    created = await store.create("acme", "batch", "in.jsonl", LINES)
    assert re.fullmatch(r"file-[0-9a-f]{24}", created.id)
    assert (created.tenant, created.purpose, created.filename, created.bytes,
            created.status) == ("acme", "batch", "in.jsonl", len(LINES), "processed")
    assert abs(created.created_at - time.time()) < 5
    assert await store.get("acme", created.id) == created
    assert await store.read("acme", created.id) == LINES


async def test_a_streamed_file_comes_back_identical_in_chunks(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    created = await store.create("acme", "batch_output", "out.jsonl", pieces(data, 70_000))
    assert created.bytes == len(data)
    found, chunks = await store.open("acme", created.id)
    got = [chunk async for chunk in chunks]
    assert found == created and b"".join(got) == data
    assert max(len(c) for c in got) <= CHUNK_BYTES and len(got) >= 3


async def test_the_record_names_its_tenant_and_the_directory_does_not(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    created = await store.create("acme corp/../x", "batch", "in.jsonl", LINES)
    directory = store.tenant_dir("acme corp/../x")
    assert directory.parent == tmp_path / "files" and re.fullmatch(r"[0-9a-f]{32}",
                                                                   directory.name)
    assert visible_names(directory) == [created.id, f"{created.id}.json"]
    record = json.loads((directory / f"{created.id}.json").read_text())
    assert record["tenant"] == "acme corp/../x" and record["bytes"] == len(LINES)
    assert (directory / created.id).read_bytes() == LINES


async def test_leftovers_of_a_crash_are_never_seen(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    kept = await store.create("acme", "batch", "in.jsonl", LINES)
    directory = store.tenant_dir("acme")
    # a crash mid-write leaves a temporary file; one before the record, a content file
    half = new_file_id()
    (directory / f".{half}.0badf00d.tmp").write_bytes(b'{"half": ')
    orphan = new_file_id()
    (directory / orphan).write_bytes(LINES)
    (directory / f".{orphan}.json.0badf00d.tmp").write_text('{"id": "')
    page = await store.list("acme")
    assert [f.id for f in page.data] == [kept.id]
    for file_id in (half, orphan):
        with pytest.raises(FileNotFound):
            await store.get("acme", file_id)
        with pytest.raises(FileNotFound):
            await store.read("acme", file_id)


async def test_a_failed_upload_leaves_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path)

    async def refused() -> AsyncIterator[bytes]:
        yield b'{"ok": 1}\n'
        yield b"not json\n"
        raise InvalidRequest("Line 2 of the file is not valid JSON.", param="file")

    with pytest.raises(InvalidRequest, match="Line 2"):
        await store.create("acme", "batch", "in.jsonl", refused())
    assert visible_names(store.tenant_dir("acme")) == []
    assert (await store.list("acme")).data == ()


async def test_a_cancelled_upload_leaves_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    started = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield b'{"ok": 1}\n'
        started.set()
        await asyncio.sleep(30)
        yield b'{"never": 1}\n'

    task = asyncio.create_task(store.create("acme", "batch", "in.jsonl", stalls()))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert visible_names(store.tenant_dir("acme")) == []


@pytest.mark.parametrize("bad_id", [
    "../x", "file-../../../etc/passwd", "file-0123456789abcdef0123456/", "file-",
    "FILE-0123456789abcdef01234567", "file-0123456789ABCDEF01234567",
    "file-0123456789abcdef01234567.json", "file-0123456789abcdef0123456\x00", "",
])
async def test_a_malformed_id_never_reaches_the_disk(tmp_path: Path, bad_id: str) -> None:
    store = make_store(tmp_path)
    await store.create("acme", "batch", "in.jsonl", LINES)
    for call in (store.get, store.read, store.delete):
        with pytest.raises(FileNotFound) as caught:
            await call("acme", bad_id)
        assert caught.value.status == 404
        assert caught.value.message == "File not found: that id."  # never echoed
    with pytest.raises(FileNotFound):
        await store.open("acme", bad_id)


async def test_a_path_to_another_tenants_file_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    theirs = await store.create("globex", "batch", "secret.jsonl", LINES)
    sneaky = f"../{store.tenant_dir('globex').name}/{theirs.id}"
    with pytest.raises(FileNotFound):
        await store.read("acme", sneaky)
    assert await store.read("globex", theirs.id) == LINES


async def test_tenants_never_see_each_others_files(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    theirs = await store.create("globex", "batch", "secret.jsonl", LINES)
    mine = await store.create("acme", "batch", "mine.jsonl", b'{"x": 1}\n')
    for call in (store.get, store.read, store.delete):
        with pytest.raises(FileNotFound) as caught:
            await call("acme", theirs.id)
        # the same answer as for an id nobody has
        with pytest.raises(FileNotFound) as unknown:
            await call("acme", new_file_id())
        assert caught.value.status == unknown.value.status == 404
        assert caught.value.code == unknown.value.code == "file_not_found"
    assert [f.id for f in (await store.list("acme")).data] == [mine.id]
    assert [f.id for f in (await store.list("globex")).data] == [theirs.id]
    assert await store.read("globex", theirs.id) == LINES  # acme's delete changed nothing


async def test_a_record_that_names_another_tenant_is_not_found(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    created = await store.create("acme", "batch", "in.jsonl", LINES)
    record = store.tenant_dir("acme") / f"{created.id}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "tenant": "globex"}))
    with pytest.raises(FileNotFound):
        await store.get("acme", created.id)


async def make_files(store: LocalFileStore, tenant: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        purpose: FilePurpose = "batch_output" if i % 3 == 2 else "batch"
        ids.append((await store.create(tenant, purpose, f"{i}.jsonl", LINES)).id)
        await asyncio.sleep(0.002)  # ids carry the millisecond: creation order is id order
    return ids


async def test_a_listing_is_newest_first_unless_asked(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ids = await make_files(store, "acme", 6)
    assert ids == sorted(ids)
    newest_first = await store.list("acme")
    assert [f.id for f in newest_first.data] == ids[::-1] and not newest_first.has_more
    oldest_first = await store.list("acme", order="asc")
    assert [f.id for f in oldest_first.data] == ids
    outputs = await store.list("acme", purpose="batch_output", order="asc")
    assert [f.id for f in outputs.data] == [ids[2], ids[5]]
    assert (await store.list("acme", purpose="fine-tune")).data == ()
    assert (await store.list("nobody")).data == ()


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_pages_cover_every_file_once(tmp_path: Path, order: str) -> None:
    store = make_store(tmp_path)
    ids = await make_files(store, "acme", 7)
    expected = ids if order == "asc" else ids[::-1]
    seen: list[str] = []
    after: str | None = None
    for _ in range(10):
        page = await store.list("acme", limit=3, after=after,
                                order="asc" if order == "asc" else "desc")
        seen += [f.id for f in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert seen == expected
    assert [len((await store.list("acme", limit=k)).data) for k in (1, 7, 8)] == [1, 7, 7]
    assert (await store.list("acme", limit=7)).has_more is False
    assert (await store.list("acme", limit=6)).has_more is True


async def test_a_deleted_cursor_still_pages(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ids = await make_files(store, "acme", 4)
    await store.delete("acme", ids[1])
    page = await store.list("acme", after=ids[1], order="asc")
    assert [f.id for f in page.data] == ids[2:]


async def test_delete_removes_the_file_for_good(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    created = await store.create("acme", "batch", "in.jsonl", LINES)
    assert await store.delete("acme", created.id) == created
    assert visible_names(store.tenant_dir("acme")) == []
    for call in (store.get, store.read, store.delete):
        with pytest.raises(FileNotFound):
            await call("acme", created.id)
    assert (await store.list("acme")).data == ()


async def test_a_download_that_began_outlives_a_delete(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    data = os.urandom(3 * CHUNK_BYTES)
    created = await store.create("acme", "batch", "in.jsonl", data)
    _, chunks = await store.open("acme", created.id)
    await store.delete("acme", created.id)
    assert b"".join([c async for c in chunks]) == data


async def test_concurrent_creates_get_ids_of_their_own(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    made = await asyncio.gather(*(store.create("acme", "batch", f"{i}.jsonl",
                                               f'{{"i": {i}}}\n'.encode()) for i in range(30)))
    assert len({f.id for f in made}) == 30
    assert {f.id for f in (await store.list("acme")).data} == {f.id for f in made}
    for f in made:
        assert await store.read("acme", f.id) == f'{{"i": {f.filename.split(".")[0]}}}\n'.encode()
