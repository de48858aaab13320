"""KV page runs on the wire without protobuf's copies: ``PrefillMessage{request_id, pages: KVPageRun}``
encoded and decoded by hand, byte for byte what ``SerializeToString`` writes (proto/prefill.proto stays
the contract: any protobuf client parses these messages).

Why: building a ``KVPageRun`` from 19 MB of bytes and serializing it copies the payload twice and ran at
0.2-0.6 GB/s here; the encoder below copies each part once (``bytes.join`` from the exporter's host
buffers), and the decoder hands out zero-copy ``memoryview`` slices of the received message.

    PrefillMessage  1: request_id (string)   3: pages (KVPageRun, length-delimited)
    KVPageRun       1: layer  2: first_page  3: num_pages (varints)   4: k  5: k_scales  6: v  7: v_scales
                    8: padding (zero bytes before a part)

Fields at their proto3 default (0, empty) are omitted, as protobuf does. With ``align`` (the default,
``PART_ALIGN``) a ``padding`` field goes before each part that would not start at a multiple of it, so a
receiver can copy the whole message at once into aligned memory and read every part where it lies (16-byte
accesses); protobuf parses the same parts either way. The decoder accepts exactly one
``pages`` payload and the request id; any other payload (header, page_refs, done) is left to protobuf
(``decode_page_run`` returns None), and anything malformed raises ``WireError``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_PAGES_FIELD = 3
_PARTS = (4, 5, 6, 7)  # k, k_scales, v, v_scales
_PADDING_FIELD = 8
PART_ALIGN = 64  # parts start at multiples of this many bytes of the message (the senders' default)


class WireError(ValueError):
    """A message that is not valid protobuf wire format (truncated, overlong varint, bad wire type)."""


class PageRunView(NamedTuple):
    """A decoded KVPageRun message: the parts are views of the received bytes (no copy); ``spans`` are their
    (start, stop) offsets in ``data`` (k, k_scales, v, v_scales)."""

    request_id: str
    layer: int
    first_page: int
    num_pages: int
    k: memoryview
    k_scales: memoryview
    v: memoryview
    v_scales: memoryview
    data: bytes = b""
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def parts(self) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        return self.k, self.k_scales, self.v, self.v_scales

    @property
    def num_bytes(self) -> int:
        return self.k.nbytes + self.k_scales.nbytes + self.v.nbytes + self.v_scales.nbytes


_SMALL_VARINTS = tuple(bytes((n,)) for n in range(0x80))  # one-byte varints, built once


def _varint(n: int) -> bytes:
    if n < 0:
        raise ValueError(f"wire varints here are non-negative, got {n}")
    if n < 0x80:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_len(n: int) -> int:
    """len(_varint(n)) without building it."""
    return max(1, (n.bit_length() + 6) // 7)


@functools.cache
def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


class Frame(NamedTuple):
    """A page run message's framing: ``head`` (request id, run header) at offset 0, then for each part its
    ``prefixes[i]`` (padding where aligned, then tag and length; empty for an absent part) immediately
    followed by its payload."""

    head: bytes
    prefixes: tuple[bytes, bytes, bytes, bytes]
    total: int  # bytes of the whole message

    def payload_offsets(self, sizes: Sequence[int]) -> list[int]:
        """Where each part's payload starts in the message."""
        out, at = [], len(self.head)
        for prefix, n in zip(self.prefixes, sizes, strict=True):
            at += len(prefix)
            out.append(at)
            at += n
        return out


@functools.lru_cache(maxsize=1024)
def _padding(at: int, prefix: int, align: int) -> bytes:
    """A padding field to place at offset ``at`` so that a part whose tag and length take ``prefix`` bytes
    starts at a multiple of ``align`` (empty where it already does). The field is >= 2 bytes (tag, length).
    Callers pass ``at`` modulo ``align`` (the result depends on nothing else of it), so the cache stays small."""
    gap = -(at + prefix) % align
    if gap == 0:
        return b""
    size = gap if gap >= 2 else gap + align
    return _tag(_PADDING_FIELD, _WIRE_LEN) + _varint(size - 2) + bytes(size - 2)  # size - 2 < 128: 1-byte length


def frame_page_run(request_id: str, layer: int, first_page: int, num_pages: int, sizes: Sequence[int],
                   align: int = PART_ALIGN) -> Frame:
    """The framing of ``PrefillMessage(request_id=..., pages=KVPageRun(layer, first_page, num_pages, ...))``
    whose four parts (k, k_scales, v, v_scales) are ``sizes`` bytes long (0: absent), each present part's
    payload at a multiple of ``align`` bytes of the message (0 or 1: no padding, protobuf's own bytes)."""
    if len(sizes) != len(_PARTS):
        raise ValueError(f"a page run has {len(_PARTS)} parts (k, k_scales, v, v_scales), got {len(sizes)}")
    if align < 0 or align > 64:
        raise ValueError(f"parts align to 0..64 bytes, got {align}")
    head = bytearray()
    for field, value in ((1, layer), (2, first_page), (3, num_pages)):
        if value:
            head += _tag(field, _WIRE_VARINT) + _varint(value)
    tags = [_tag(field, _WIRE_LEN) + _varint(n) if n else b"" for field, n in zip(_PARTS, sizes, strict=True)]
    rid = request_id.encode()
    top = _tag(1, _WIRE_LEN) + _varint(len(rid)) + rid if rid else b""
    # the run's length prefix; the padding depends on it, so settle both together (the first guess leaves out the
    # padding, a few bytes: it is right but near a varint boundary)
    run_len_bytes = _varint_len(len(head) + sum(len(t) + n for t, n in zip(tags, sizes, strict=True)))
    while True:
        prefixes, at = [], len(top) + 1 + run_len_bytes + len(head)
        for tag, n in zip(tags, sizes, strict=True):
            pad = _padding(at % align, len(tag), align) if tag and align > 1 else b""
            prefixes.append(pad + tag)
            at += len(pad) + len(tag) + n
        run_len = at - (len(top) + 1 + run_len_bytes)
        if _varint_len(run_len) == run_len_bytes:
            break
        run_len_bytes = _varint_len(run_len)
    outer = top + _tag(_PAGES_FIELD, _WIRE_LEN) + _varint(run_len)
    return Frame(outer + bytes(head), tuple(prefixes), len(outer) + run_len)


def encode_page_run(request_id: str, layer: int, first_page: int, num_pages: int,
                    parts: Sequence[Sequence[bytes | memoryview]], align: int = PART_ALIGN) -> bytes:
    """The serialized ``PrefillMessage(request_id=..., pages=KVPageRun(layer, first_page, num_pages, k, k_scales,
    v, v_scales))``; ``parts`` are the four payloads, each a list of byte buffers that concatenate to it (empty
    for absent scales), each at a multiple of ``align`` bytes (``frame_page_run``). One copy of each byte."""
    if len(parts) != len(_PARTS):
        raise ValueError(f"a page run has {len(_PARTS)} parts (k, k_scales, v, v_scales), got {len(parts)}")
    frame = frame_page_run(request_id, layer, first_page, num_pages,
                           [sum(memoryview(c).nbytes for c in chunks) for chunks in parts], align)
    pieces: list[bytes | memoryview] = [frame.head]
    for prefix, chunks in zip(frame.prefixes, parts, strict=True):
        if prefix:
            pieces += [prefix, *chunks]
    return b"".join(pieces)


def _read_varint(buf: memoryview, i: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= end:
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def _fields(buf: memoryview, i: int, end: int):
    """(field, wire type, value or (start, stop) of a length-delimited field) over buf[i:end]."""
    while i < end:
        key, i = _read_varint(buf, i, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wire == _WIRE_VARINT:
            value, i = _read_varint(buf, i, end)
            yield field, wire, value
        elif wire == _WIRE_LEN:
            n, i = _read_varint(buf, i, end)
            if n > end - i:
                raise WireError(f"field {field} claims {n} bytes, {end - i} left")
            yield field, wire, (i, i + n)
            i += n
        elif wire in (_WIRE_I64, _WIRE_I32):
            i += 8 if wire == _WIRE_I64 else 4
            if i > end:
                raise WireError(f"truncated fixed-width field {field}")
            yield field, wire, None
        else:
            raise WireError(f"field {field} has unsupported wire type {wire}")


def decode_page_run(data: bytes) -> PageRunView | None:
    """The page run of a serialized ``PrefillMessage``, or None when its payload is not ``pages`` (parse those
    with protobuf). Unknown fields are skipped, as protobuf does; the last occurrence of a field wins."""
    buf = memoryview(data)
    rid, run = b"", None
    for field, wire, value in _fields(buf, 0, len(buf)):
        if field == 1 and wire == _WIRE_LEN:
            rid = bytes(buf[value[0]:value[1]])
        elif field in (2, 4, 5) and wire == _WIRE_LEN:  # header / done / page_refs: another payload
            return None
        elif field == _PAGES_FIELD and wire == _WIRE_LEN:
            run = value
    if run is None:
        return None
    ints = {1: 0, 2: 0, 3: 0}
    spans = dict.fromkeys(_PARTS, (0, 0))
    for field, wire, value in _fields(buf, run[0], run[1]):
        if field in ints and wire == _WIRE_VARINT:
            ints[field] = value if value < 1 << 31 else value - (1 << 64)  # int32 as protobuf reads it
        elif field in spans and wire == _WIRE_LEN:
            spans[field] = value
    try:
        request_id = rid.decode()
    except UnicodeDecodeError:
        raise WireError("request_id is not UTF-8") from None
    return PageRunView(request_id, ints[1], ints[2], ints[3], *(buf[a:b] for a, b in spans.values()),
                       data=data, spans=tuple(spans.values()))
