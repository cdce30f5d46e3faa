"""The Files API of a running Conveyor, driven by the official ``openai`` client
over real HTTP: upload, retrieve, list, download byte for byte, delete; the
refusals (purpose, a line that is not JSON, a file over the limit); and, on a
gateway with API keys, pages of a tenant's files and tenants that cannot see
each other's files.

The shared ``pipeline`` keeps its files in the default directory
(``.conveyor/files`` under the repository); each test deletes what it made.
The keyed gateway is a single ``conveyor gateway`` process on a topic prefix of
its own, with its own files directory and a 4 KiB file limit: the Files API
needs no layer and no worker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.pipeline import Pipeline

SECRET = "conveyor-test-files-secret-" + uuid.uuid4().hex
SMALL_LIMIT = 4096
BATCH = b"".join(
    b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", '
    b'"body": {"model": "smollm2", "messages": [{"role": "user", "content": "Hi \xc3\xa9"}]}}\n'
    % i for i in range(3))


def client_of(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{base_url}/v1", max_retries=0, timeout=30)


@pytest.fixture
def client(pipeline: Pipeline) -> openai.OpenAI:
    return client_of(pipeline.base_url)


def test_a_batch_file_round_trips(client: openai.OpenAI, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(BATCH)
    with open(path, "rb") as handle:
        created = client.files.create(file=handle, purpose="batch")
    try:
        assert created.id.startswith("file-") and len(created.id) == 29
        assert (created.object, created.purpose, created.status) == ("file", "batch",
                                                                    "processed")
        assert (created.filename, created.bytes) == ("requests.jsonl", len(BATCH))
        assert client.files.retrieve(created.id) == created
        assert created.id in [f.id for f in client.files.list(purpose="batch")]
        assert client.files.content(created.id).content == BATCH
    finally:
        deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "file")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(created.id)
    assert created.id not in [f.id for f in client.files.list()]


@pytest.mark.parametrize(("content", "purpose", "param", "message"), [
    (BATCH, "fine-tune", "purpose", "purpose 'fine-tune'"),
    (BATCH, "assistants", "purpose", "purpose 'assistants'"),
    (BATCH + b"{not json}\n", "batch", "file", "Line 4 of the file is not valid JSON"),
    (b'{"a": 1}\n\n[1, 2]\n', "batch", "file", "Line 3 of the file is not a JSON object"),
    (b"", "batch", "file", "The file is empty"),
])
def test_a_refused_upload_is_400(client: openai.OpenAI, content: bytes, purpose: str,
                                 param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", content), purpose=purpose)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"] == param and message in body["message"]
    assert body["type"] == "invalid_request_error"


class Keyed:
    def __init__(self, p: Pipeline, url: str, files_dir: Path) -> None:
        self.p = p
        self.url = url
        self.files_dir = files_dir

    def key(self, tenant: str) -> str:
        out = self.p.cli("keys", "create", "--tenant", tenant, "--name", "files-test")
        return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def keyed(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    files_dir = tmp_path_factory.mktemp("files")
    p = Pipeline(tmp_path_factory.mktemp("files-logs"), CONVEYOR_AUTH="keys",
                 CONVEYOR_AUTH_SECRET=SECRET, CONVEYOR_FILES_DIR=str(files_dir),
                 CONVEYOR_MAX_FILE_BYTES=str(SMALL_LIMIT))
    try:
        p.cli("topics")
        yield Keyed(p, p.start_gateway("gateway"), files_dir)
    finally:
        p.close()


def test_tenants_never_see_each_others_files(keyed: Keyed) -> None:
    tenant = f"t{uuid.uuid4().hex[:8]}"
    owner = client_of(keyed.url, keyed.key(tenant))
    other = client_of(keyed.url, keyed.key(f"o{uuid.uuid4().hex[:8]}"))
    colleague = client_of(keyed.url, keyed.key(tenant))  # another key of the same tenant
    created = owner.files.create(file=("mine.jsonl", BATCH), purpose="batch")
    assert any(p.is_file() and p.name == created.id for p in keyed.files_dir.rglob("*"))

    unknown = "file-" + "0" * 24
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError) as theirs:
            call(created.id)
        with pytest.raises(openai.NotFoundError) as nobodys:
            call(unknown)
        assert theirs.value.code == nobodys.value.code == "file_not_found"
    assert other.files.list().data == []
    assert [f.id for f in colleague.files.list()] == [created.id]
    assert colleague.files.content(created.id).content == BATCH
    assert owner.files.delete(created.id).deleted


def test_the_client_pages_through_the_files(keyed: Keyed) -> None:
    client = client_of(keyed.url, keyed.key(f"t{uuid.uuid4().hex[:8]}"))
    made = [client.files.create(file=(f"{i}.jsonl", BATCH), purpose="batch").id
            for i in range(3)]
    try:
        first = client.files.list(limit=2, order="asc", after=made[0])
        assert [f.id for f in first.data] == made[1:] and first.has_more is False
        # auto-paging asks for each next page with after=<last id>
        assert [f.id for f in client.files.list(limit=1, order="asc")] == made
        assert [f.id for f in client.files.list(limit=2)] == made[::-1]
        newest = client.files.list(limit=1)
        assert newest.data[0].id == made[-1] and newest.has_more is True
    finally:
        for file_id in made:
            client.files.delete(file_id)


def test_files_need_a_key(keyed: Keyed) -> None:
    r = httpx.get(f"{keyed.url}/v1/files", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{keyed.url}/v1/files", data={"purpose": "batch"},
                   files={"file": ("a.jsonl", BATCH)}, timeout=10)
    assert r.status_code == 401


def test_a_file_over_the_limit_is_413(keyed: Keyed) -> None:
    client = client_of(keyed.url, keyed.key(f"t{uuid.uuid4().hex[:8]}"))
    line = b'{"custom_id": "x"}\n'
    at_limit = line * (SMALL_LIMIT // len(line))
    at_limit += b" " * (SMALL_LIMIT - len(at_limit))
    assert client.files.create(file=("full.jsonl", at_limit), purpose="batch").bytes == \
        SMALL_LIMIT
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("over.jsonl", at_limit + b" "), purpose="batch")
    assert caught.value.status_code == 413 and caught.value.code == "request_too_large"
    assert len(client.files.list().data) == 1
