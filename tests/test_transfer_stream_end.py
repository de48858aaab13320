"""A completed transfer's stream ends on the prefill's side, not by the decode's cancel: the decode has every page
and the first token once PrefillDone arrives, but the prefill still has work after it (a by-reference hold's
release, lanes that drain, its own accounting). A cancel that raced that work would end the prefill's stream as a
failure and the transfer would go uncounted there. ``--debug-done-delay-s`` widens that window so a decode that
cancels right after PrefillDone is caught every time. Real services on free ports, driven over gRPC."""

from __future__ import annotations

import time

import pytest

from decode_svc.transfer_phases import PHASES
from tests.service_procs import start_many, stop_all
from tests.test_sender_process import _prefill_metric
from tests.test_services import CPU, gen_request, generate, metric, prompt, run
from tests.test_timeouts import decode_is_idle, prefill_is_idle


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
        rep = run(decode_is_idle(d.address))
        assert rep.ok and rep.num_in_use == 0
        # the decode's span of the transfer, cut into its phases (decode_svc/transfer_phases.py)
        phases = {name: run(metric(d.address, f'nvfp4_decode_kv_transfer_phase_seconds_total{{phase="{name}"}}'))
                  for name in PHASES}
        assert all(v >= 0 for v in phases.values()) and phases["first_page"] > 0, phases
        assert sum(phases.values()) == pytest.approx(run(metric(d.address, "nvfp4_decode_kv_transfer_seconds_total")),
                                                     rel=1e-6, abs=1e-9)
    finally:
        stop_all([p, d])


def test_a_prefill_that_holds_its_stream_open_after_prefill_done_is_cancelled_and_the_request_goes_on(
        tiny_model_dir):
    args = ("--model", tiny_model_dir, "--page-size", "4")
    p, d = start_many([("prefill_svc", *CPU, *args, "--debug-done-delay-s", "60"),
                       ("decode_svc", *CPU, *args, "--kv-transfer", "grpc")])
    try:
        t0 = time.monotonic()
        tokens, _ = run(generate(d.address, gen_request("held", prompt(24), p.address, max_tokens=3)))
        assert len(tokens) == 3 and time.monotonic() - t0 < 30  # the decode's bound on the end (2 s), not the 60 s
        load = run(prefill_is_idle(p.address))  # the cancel ended the prefill's stream: its pages are free
        assert load.pool_pages_in_use == 0 and load.num_running == 0
        assert run(_prefill_metric(p.address, 'nvfp4_prefill_requests_total{outcome="failed"}')) == 1
        rep = run(decode_is_idle(d.address))
        assert rep.ok and rep.num_in_use == 0
    finally:
        stop_all([p, d])


def test_a_transfers_phases_add_up_to_its_span_and_one_without_page_messages_waits_in_first_page():
    from decode_svc.transfer_phases import TransferClock

    clock = TransferClock(header=10.0, first_page=10.5, last_page=12.0, done=12.25, drained=13.0)
    p = clock.phases(end=13.5)
    assert (p.first_page, p.stream, p.done, p.drain, p.finish) == (0.5, 1.5, 0.25, 0.75, 0.5)
    assert p.total == 3.5 and "first page 500.0 ms" in p.summary()
    empty = TransferClock(header=1.0, done=2.0).phases(end=2.5)
    assert (empty.first_page, empty.stream, empty.done, empty.drain, empty.finish) == (1.0, 0.0, 0.0, 0.0, 0.5)
    live = TransferClock(header=0.0)
    live.page()
    live.page()
    live.got_done()
    live.writes_drained()
    q = live.phases()
    assert live.first_page <= live.last_page <= live.done <= live.drained and min(v for _, v in q.items()) >= 0
