"""The images of chat messages in the file store: each kept once per tenant
under an id made from its bytes' sha256 (the same image sent again is the same
file, written once), purpose ``vision``; read back by the infer worker, whose
engine sends the bytes on. Why by reference: docs/decisions/0036-images.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from conveyor.errors import InvalidRequest, RequestError
from conveyor.files.local import LocalFileStore
from conveyor.files.store import FileNotFound

__all__ = ["ImageStore", "FileStoreUnavailable", "image_file_id"]

log = logging.getLogger(__name__)


class FileStoreUnavailable(RequestError):
    """The file store could not keep or give back an image (a disk fault)."""

    status = 503
    type = "service_unavailable"
    code = "file_store_unavailable"


def image_file_id(sha256_hex: str) -> str:
    """``file-`` and the first 24 hex digits of the image's sha256."""
    return f"file-{sha256_hex[:24]}"


class ImageStore:
    """Images kept in (and read from) ``files``, a tenant's apart from another's."""

    def __init__(self, files: LocalFileStore) -> None:
        self.files = files

    async def put(self, tenant: str, data: bytes, media_type: str, sha256_hex: str) -> str:
        """Keep ``data``, whose sha256 is ``sha256_hex`` (taken with the image's
        check, off the event loop), unless the tenant has it already: its file id."""
        file_id = image_file_id(sha256_hex)
        try:
            try:
                found = await self.files.get(tenant, file_id)
                if found.purpose == "vision" and found.bytes == len(data):
                    await self.files.touch(tenant, file_id)  # kept a retention more
                    return file_id
            except FileNotFound:
                pass
            suffix = media_type.removeprefix("image/")
            await self.files.create(tenant, "vision", f"image.{suffix}", data, file_id=file_id)
        except OSError as exc:
            raise FileStoreUnavailable(f"The image could not be stored ({exc.strerror or exc}); "
                                       "try again later.") from exc
        return file_id

    async def sweep(self, retention_s: float) -> int:
        """Delete every tenant's images not sent for ``retention_s``: how many."""
        gone = 0
        for image in await self.files.unused_since("vision", time.time() - retention_s):
            try:
                await self.files.delete(image.tenant, image.id)
                gone += 1
            except FileNotFound:  # another gateway's sweep deleted it first
                pass
        return gone

    async def keep_swept(self, retention_s: float, every_s: float = 3600.0) -> None:
        """:meth:`sweep` at once and every ``every_s``, for as long as it runs; a
        file store that fails is tried again at the next turn."""
        while True:
            try:
                gone = await self.sweep(retention_s)
                if gone:
                    log.info("image retention: %d images not sent for %.0f days deleted",
                             gone, retention_s / 86_400)
            except OSError as exc:
                log.warning("image retention: the file store failed (%r); trying again "
                            "in %.0f s", exc, every_s)
            await asyncio.sleep(every_s)

    async def read(self, tenant: str, file_id: str, sha256_hex: str, part: str) -> bytes:
        """The bytes of an image kept by :meth:`put`; an :class:`InvalidRequest`
        naming ``part`` when it is gone (deleted through the Files API) or not
        the bytes it was."""
        try:
            data = await self.files.read(tenant, file_id)
        except FileNotFound:
            raise InvalidRequest(f"The image of '{part}' ({file_id}) is no longer in the "
                                 "file store.", param=part or None) from None
        except OSError as exc:
            raise FileStoreUnavailable(f"The image of '{part}' could not be read "
                                       f"({exc.strerror or exc}); try again later.") from exc
        if hashlib.sha256(data).hexdigest() != sha256_hex:
            raise InvalidRequest(f"The image of '{part}' ({file_id}) in the file store is "
                                 "not the one sent.", param=part or None)
        return data
