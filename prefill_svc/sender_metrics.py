"""The sender process's own Prometheus counters (``--kv-sender process``): whether its exports keep up with its
streams. The service's GetMetrics answer is the engine process's text with these appended."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from prefill_svc.page_sender import PageSender


class SenderMetrics:
    """``nvfp4_prefill_sender_transfers_total{outcome}``  grpc transfers sent by the sender (ok | failed)
    ``nvfp4_prefill_sender_bytes_total``                 page message bytes it sent
    ``nvfp4_prefill_sender_export_seconds_total``        time its exports ran (gather, copy to host, framing;
                                                          summed over its threads)
    ``nvfp4_prefill_sender_export_wait_seconds_total``   time its streams waited for an export (the share of
                                                          a transfer's time the exports did not keep up)"""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "nvfp4_prefill_sender"
        self.transfers = Counter(f"{p}_transfers", "grpc transfers sent by the sender process, by outcome",
                                 ["outcome"], registry=r)
        self.bytes = Counter(f"{p}_bytes", "page message bytes sent by the sender process", registry=r)
        self.export_seconds = Counter(f"{p}_export_seconds", "time the sender's exports ran (gather, copy to "
                                      "host, framing; summed over its threads)", registry=r)
        self.export_wait_seconds = Counter(f"{p}_export_wait_seconds", "time the sender's streams waited for an "
                                           "export", registry=r)

    def observe(self, sender: PageSender, ok: bool) -> None:
        """One transfer's counters, whatever ended it."""
        self.transfers.labels("ok" if ok else "failed").inc()
        self.bytes.inc(sender.num_bytes)
        self.export_seconds.inc(sender.export_s)
        self.export_wait_seconds.inc(sender.export_wait_s)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
