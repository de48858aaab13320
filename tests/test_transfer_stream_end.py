"""A completed transfer's stream ends on the prefill's side, not by the decode's cancel: the decode has every page
and the first token once PrefillDone arrives, but the prefill still has work after it (a by-reference hold's
release, lanes that drain, its own accounting). A cancel that raced that work would end the prefill's stream as a
failure and the transfer would go uncounted there. ``--debug-done-delay-s`` widens that window so a decode that
cancels right after PrefillDone is caught every time. Real services on free ports, driven over gRPC."""

from __future__ import annotations

import pytest

from tests.service_procs import start_many, stop_all
from tests.test_sender_process import _prefill_metric
from tests.test_services import CPU, gen_request, generate, integrity, metric, prompt, run
from tests.test_timeouts import prefill_is_idle


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_the_prefill_counts_a_completed_transfer_as_ok_when_its_stream_ends_after_prefill_done(
        tiny_model_dir, lanes):
    args = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = start_many([("prefill_svc", *CPU, *args, "--debug-done-delay-s", "0.5"),
                       ("decode_svc", *CPU, *args, "--kv-transfer", "grpc", "--kv-grpc-lanes", lanes)])
    try:
        tokens, _ = run(generate(d.address, gen_request("done", prompt(24), p.address, max_tokens=3)))
        assert len(tokens) == 3
        load = run(prefill_is_idle(p.address))
        assert load.pool_pages_in_use == 0 and load.num_running == 0
        assert run(_prefill_metric(p.address, 'nvfp4_prefill_requests_total{outcome="ok"}')) == 1
        assert run(_prefill_metric(p.address, 'nvfp4_prefill_requests_total{outcome="failed"}')) == 0
        sent = run(_prefill_metric(p.address, "nvfp4_prefill_kv_transfer_bytes_total"))  # pages and framing
        assert sent >= run(metric(d.address, "nvfp4_decode_kv_transfer_bytes_total")) > 0
        rep = run(integrity(d.address))
        assert rep.ok and rep.num_in_use == 0
    finally:
        stop_all([p, d])
