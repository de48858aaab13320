"""The transfer handshake: the KV layout both ends must share, and the check that names what differs."""

from __future__ import annotations

from nvfp4_serve_proto import common_pb2
from svc_common.errors import LayoutMismatch

_FIELDS = ("kv_dtype", "kv_rotation", "page_size", "num_layers", "num_kv_heads", "head_dim", "model_fingerprint")


def layout_of(engine) -> common_pb2.KVLayout:
    mc, cc = engine.model_config, engine.config.cache
    return common_pb2.KVLayout(
        kv_dtype=cc.kv_dtype, page_size=cc.page_size, num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, k_scales=engine.k_scales,
        v_scales=engine.v_scales, model_fingerprint=engine.fingerprint, kv_rotation=cc.kv_rotation)


def check_layout(mine: common_pb2.KVLayout, theirs: common_pb2.KVLayout, me: str, them: str) -> None:
    """Raise LayoutMismatch naming every field where ``theirs`` differs from ``mine``."""
    diffs = []
    for f in _FIELDS:
        a, b = getattr(mine, f), getattr(theirs, f)
        if a != b:
            diffs.append(f"{f}: {me} has {a!r}, {them} has {b!r}")
    for f in ("k_scales", "v_scales"):
        a, b = list(getattr(mine, f)), list(getattr(theirs, f))
        if a != b:
            diffs.append(f"{f}: {me} has {a}, {them} has {b}")
    if diffs:
        raise LayoutMismatch("KV layout mismatch between prefill and decode (start both with the same "
                             "--kv-cache-dtype, --kv-rotation, --page-size, model and --kv-scales): " + "; ".join(diffs))
