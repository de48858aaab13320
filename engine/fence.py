"""``Fence``: completion of the device work queued so far on one stream (a recorded CUDA event)."""

from __future__ import annotations

import torch


class Fence:
    """Completion of the work issued so far on the current stream of a device (a recorded CUDA event);
    on the CPU every write is already complete when it returns, and ``wait`` returns at once."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Block until the fenced work is complete (call from a worker thread, not an event loop)."""
        if self.event is not None:
            self.event.synchronize()

    def order(self, stream: torch.cuda.Stream | None) -> None:
        """Make later work on ``stream`` wait for the fenced work, without blocking the host."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)
