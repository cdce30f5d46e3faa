"""Images in the file store (conveyor/files/images.py): kept once per tenant
under an id of their bytes, read back checked."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from conveyor.errors import InvalidRequest
from conveyor.files.images import FileStoreUnavailable, ImageStore, image_file_id
from conveyor.files.local import LocalFileStore
from conveyor.settings import load_settings
from tests.support.images import image_bytes


@pytest.fixture
def files(tmp_path: Path) -> LocalFileStore:
    return LocalFileStore(load_settings(files_dir=tmp_path / "files").jobs)


async def test_the_same_image_is_one_file_of_its_tenant(files: LocalFileStore) -> None:
    store, data = ImageStore(files), image_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert await store.put("acme", data, "image/png", digest) == image_file_id(digest)
    assert await store.put("acme", data, "image/png", digest) == image_file_id(digest)
    page = await files.list("acme")
    assert [(f.purpose, f.filename, f.bytes) for f in page.data] == [
        ("vision", "image.png", len(data))]
    assert await store.read("acme", image_file_id(digest), digest, "p") == data
    with pytest.raises(InvalidRequest, match="no longer in the file store"):
        await store.read("beta", image_file_id(digest), digest, "p")  # another tenant's


async def test_an_image_deleted_or_changed_is_the_client_s_error_naming_the_part(
        files: LocalFileStore) -> None:
    store, data = ImageStore(files), image_bytes()
    digest = hashlib.sha256(data).hexdigest()
    file_id = await store.put("acme", data, "image/png", digest)
    (files.tenant_dir("acme") / file_id).write_bytes(image_bytes(color=(0, 0, 0)))
    with pytest.raises(InvalidRequest, match="not the one sent") as caught:
        await store.read("acme", file_id, digest, "messages[1].content[0]")
    assert caught.value.param == "messages[1].content[0]"
    await files.delete("acme", file_id)
    with pytest.raises(InvalidRequest, match="no longer"):
        await store.read("acme", file_id, digest, "messages[1].content[0]")


async def test_a_store_that_cannot_write_is_a_503(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = ImageStore(LocalFileStore(load_settings(files_dir=blocker).jobs))
    with pytest.raises(FileStoreUnavailable) as caught:
        await store.put("acme", image_bytes(), "image/png", "ab" * 32)
    assert caught.value.status == 503 and caught.value.code == "file_store_unavailable"


async def test_images_not_sent_for_their_retention_are_deleted_and_others_kept(
        files: LocalFileStore) -> None:
    store = ImageStore(files)
    old, again, new = image_bytes("PNG", (2, 2)), image_bytes("PNG", (3, 3)), image_bytes()
    ids = {}
    for tenant, data in (("acme", old), ("acme", again), ("beta", new)):
        digest = hashlib.sha256(data).hexdigest()
        ids[data] = (tenant, await store.put(tenant, data, "image/png", digest), digest)
    # a batch's file beside them is never an image's to sweep
    batch = await files.create("acme", "batch", "in.jsonl", b"{}\n")
    month_ago = time.time() - 32 * 86_400
    for data in (old, again):
        tenant, file_id, _ = ids[data]
        os.utime(files.tenant_dir(tenant) / file_id, (month_ago, month_ago))
    os.utime(files.tenant_dir("acme") / batch.id, (month_ago, month_ago))
    tenant, _, digest = ids[again]
    await store.put(tenant, again, "image/png", digest)  # sent again: kept a retention more
    assert await store.sweep(31 * 86_400) == 1
    left = {(f.tenant, f.id) for t in ("acme", "beta") for f in (await files.list(t)).data}
    assert left == {ids[again][:2], ids[new][:2], ("acme", batch.id)}
    assert await store.sweep(31 * 86_400) == 0
