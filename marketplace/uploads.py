"""How the web app receives a file upload (settings.FILE_UPLOAD_HANDLERS): always streamed to a temporary file,
never held in memory, and never stored past TESSERA_UPLOAD_MAX_BYTES."""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadhandler import TemporaryFileUploadHandler


class CappedUploadHandler(TemporaryFileUploadHandler):
    """Django's temporary-file handler, which stops writing once a file passes TESSERA_UPLOAD_MAX_BYTES: the rest
    of the body is read and dropped, and the file reports the size it was sent with, so the service refuses it with
    the limit (a 400) instead of first filling the web host's disk. A reverse proxy's body limit (e.g. nginx
    ``client_max_body_size``) stops such a request even earlier."""

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes | None:
        if start + len(raw_data) > settings.TESSERA_UPLOAD_MAX_BYTES:
            return None  # dropped; the parser still counts it into the file's size
        super().receive_data_chunk(raw_data, start)
        return None
