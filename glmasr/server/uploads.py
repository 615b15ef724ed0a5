"""Receiving an upload: the request body read under time and size limits, parsed as multipart/form-data as it
arrives, the file part spooled to disk past 1 MiB.

- Uploads in progress are counted apart from engine work (``serving.upload_slots``, ``--max-uploads``): a request takes an
  admission slot (``--max-queue``) only once its body is in, so clients that trickle or stall their uploads cannot
  lock everyone else out of the engine.
- Time: at most ``read_timeout_s`` without a byte of the body, at most ``upload_timeout_s`` for the whole of it:
  past either the answer is a 408 in the envelope and the connection is closed. When the server starts to drain
  (SIGTERM), bodies still arriving are refused at once with a 503: only admitted work is drained.
- Size: the body may exceed the file limit by ``FORM_OVERHEAD`` (the other fields and the multipart framing) and
  ``MAX_REFERENCES_BYTES`` (known speakers' reference clips); a larger body is a 413 (read and dropped up to
  ``DRAIN_LIMIT`` more, so the client sees the answer, then the connection is closed). A text field is at most
  ``MAX_FIELD_BYTES`` and all of them ``MAX_FIELDS_BYTES``, except ``known_speaker_references[]`` (data URLs of
  audio): each at most ``protocol.MAX_REFERENCE_BYTES`` (4 MiB), all of them ``MAX_REFERENCES_BYTES``.
- Memory: each upload in progress holds at most ~1 MiB of file (Starlette's spooled file threshold), 256 KiB of
  text fields, 16 MiB of reference clips (only requests that send them) and one received chunk;
  the decoder reads the spooled file (``audio.decode_audio_file``: by its file descriptor once on disk, from a
  memfd copy while still in memory, i.e. up to 1 MiB more), so no copy of a large upload sits in memory.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import FormData, Headers
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from .http import HttpLimits
from .protocol import MAX_KNOWN_SPEAKERS, MAX_REFERENCE_BYTES, APIError, bad_request

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
MIB = 1024 * 1024
FORM_OVERHEAD = MIB  # bytes allowed in the body beyond the file: the other fields and the multipart framing
DRAIN_LIMIT = 64 * MIB  # an oversized body is read (and dropped) up to this much, so the client sees the 413
MAX_FIELD_BYTES = 64 * 1024  # one text field (prompt, keywords, ...): far above what any valid field needs
MAX_FIELDS_BYTES = 256 * 1024  # all text fields of one request together (they are held in memory)
MAX_PART_HEADER_BYTES = 8 * 1024  # the headers of one multipart part
MAX_FIELDS = 256
MAX_FILES = 4
REFERENCE_FIELDS = ("known_speaker_references[]", "known_speaker_references")
MAX_REFERENCES_BYTES = MAX_KNOWN_SPEAKERS * MAX_REFERENCE_BYTES  # all references of one request


class ShuttingDown(APIError):
    def __init__(self):
        super().__init__(503, "the server is shutting down; retry on another instance", type="server_error",
                         code="shutting_down", headers={"Connection": "close", "Retry-After": "1"})


def too_large(limit: int) -> APIError:
    return APIError(413, f"the upload exceeds this server's limit of {limit / MIB:g} MiB (--max-upload-mb)",
                    param="file", code="file_too_large", headers={"Connection": "close"})


async def _next_message(request: Request, timeout: float, what: str) -> dict:
    """The next ASGI message of the request body; ``APIError`` 408 after ``timeout`` s. (Draining is watched once
    per upload, by ``read_form``: a task and a wait per body chunk cost the event loop more than the chunk.)"""
    try:
        if _timeout is None:  # Python 3.10: wait_for (a task per call)
            return await asyncio.wait_for(request.receive(), timeout)
        async with _timeout(timeout):
            return await request.receive()
    except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
        raise APIError(408, what, code="upload_timeout", headers={"Connection": "close"}) from None


async def _unless_draining(work, draining: asyncio.Event | None):
    """``await work``, or ``ShuttingDown`` as soon as ``draining`` is set (the work is cancelled)."""
    if draining is None:
        return await work
    if draining.is_set():
        work.close()
        raise ShuttingDown()
    task = asyncio.ensure_future(work)
    drain = asyncio.ensure_future(draining.wait())
    try:
        await asyncio.wait({task, drain}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request was cancelled: so is its work, and the cancellation goes on
        task.cancel()
        raise
    finally:
        drain.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the drain's answer goes out instead
        pass
    raise ShuttingDown()


async def _body_chunks(request: Request, limit: int, limits: HttpLimits):
    """The body's chunks as they arrive, under the time and size limits (see the module docstring)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.upload_timeout_s
    cap = limit + FORM_OVERHEAD + MAX_REFERENCES_BYTES
    seen = 0
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise APIError(408, f"the upload took longer than {limits.upload_timeout_s:g} s (--upload-timeout); "
                                f"{seen} bytes were received", code="upload_timeout",
                           headers={"Connection": "close"})
        if left < limits.read_timeout_s:
            what = (f"the upload took longer than {limits.upload_timeout_s:g} s (--upload-timeout)")
        else:
            what = (f"the upload stalled: no data for {limits.read_timeout_s:g} s (--read-timeout) after {seen} "
                    "bytes")
        msg = await _next_message(request, min(left, limits.read_timeout_s), what)
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = msg.get("body", b"")
        seen += len(chunk)
        if seen > cap:
            await _drop_rest(request, seen, cap + DRAIN_LIMIT, limits)
            raise too_large(limit)
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            return


async def _drop_rest(request: Request, seen: int, until: int, limits: HttpLimits) -> None:
    """Read and drop what is left of an oversized body (up to ``until`` bytes), so the client, still sending, sees
    the 413 instead of a reset connection; gives up quietly on a stall or a disconnect."""
    more = True
    while more and seen <= until:
        try:
            msg = await _next_message(request, limits.read_timeout_s, "")
        except APIError:
            return
        if msg["type"] == "http.disconnect":
            return
        seen += len(msg.get("body", b""))
        more = msg.get("more_body", False)


class _FormParser(MultiPartParser):
    """Starlette's streaming multipart parser with the memory of text fields and part headers bounded (file parts
    are spooled): one field at most ``MAX_FIELD_BYTES``, all together ``MAX_FIELDS_BYTES``, one part's headers
    ``MAX_PART_HEADER_BYTES``; past them a 400 naming the field. Reference clips (``REFERENCE_FIELDS``) have
    their own limits: ``MAX_REFERENCE_BYTES`` each, ``MAX_REFERENCES_BYTES`` together."""

    _fields_bytes = 0
    _reference_bytes = 0
    _header_bytes = 0

    def on_part_begin(self) -> None:
        super().on_part_begin()
        self._header_bytes = 0

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._current_part
        if part.file is None:
            size = end - start
            name = part.field_name
            if name in REFERENCE_FIELDS:
                self._reference_bytes += size
                if len(part.data) + size > MAX_REFERENCE_BYTES:
                    raise bad_request(f"a {name} entry is longer than {MAX_REFERENCE_BYTES // MIB} MiB (the limit "
                                      "per reference clip)", "known_speaker_references", "field_too_large")
                if self._reference_bytes > MAX_REFERENCES_BYTES:
                    raise bad_request(f"the {name} entries together exceed {MAX_REFERENCES_BYTES // MIB} MiB",
                                      "known_speaker_references", "field_too_large")
                super().on_part_data(data, start, end)
                return
            self._fields_bytes += size
            if len(part.data) + size > MAX_FIELD_BYTES:
                raise bad_request(f"the field {name!r} is longer than {MAX_FIELD_BYTES // 1024} KiB", name,
                                  "field_too_large")
            if self._fields_bytes > MAX_FIELDS_BYTES:
                raise bad_request(f"the text fields together exceed {MAX_FIELDS_BYTES // 1024} KiB", name,
                                  "field_too_large")
        super().on_part_data(data, start, end)

    def _count_header(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_PART_HEADER_BYTES:
            raise bad_request(f"a multipart part's headers exceed {MAX_PART_HEADER_BYTES // 1024} KiB", None,
                              "invalid_multipart")

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        super().on_header_field(data, start, end)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        super().on_header_value(data, start, end)


async def read_form(request: Request, limit: int, limits: HttpLimits, draining: asyncio.Event | None = None
                    ) -> FormData:
    """The request's multipart form, its file parts spooled (the caller closes the form). Raises ``APIError`` (400
    not multipart or malformed, 408 too slow, 413 too large, 503 draining) or ``ClientDisconnect``."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request(f"the request body must be multipart/form-data (as the OpenAI clients send it), got "
                          f"{content_type or 'no content type'!r}", None, "invalid_content_type")
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and \
            int(length) > limit + FORM_OVERHEAD + MAX_REFERENCES_BYTES + DRAIN_LIMIT:
        raise too_large(limit)  # too large to read and drop: answered at once, the connection closed
    parser = _FormParser(Headers(raw=request.scope["headers"]), _body_chunks(request, limit, limits),
                         max_files=MAX_FILES, max_fields=MAX_FIELDS, max_part_size=MAX_REFERENCE_BYTES)
    try:
        return await _unless_draining(parser.parse(), draining)
    except MultiPartException as e:
        raise bad_request(f"malformed multipart body: {e.message}", None, "invalid_multipart") from None
