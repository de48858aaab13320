from __future__ import annotations

import pytest


def test_generated_stubs_match_the_proto_sources():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) regenerates the stubs")
    from nvfp4_serve.gen_proto import stale_files

    assert stale_files() == [], "run: python -m nvfp4_serve.gen_proto"


def test_stubs_are_importable_from_the_installed_package():
    from nvfp4_serve_proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    assert hasattr(decode_pb2_grpc, "DecodeStub") and hasattr(prefill_pb2_grpc, "PrefillStub")
    layout = common_pb2.KVLayout(kv_dtype="nvfp4", page_size=16)
    assert common_pb2.KVLayout.FromString(layout.SerializeToString()).page_size == 16
