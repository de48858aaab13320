"""free_port: a port for a service that binds it later, drawn below the kernel's ephemeral range so that no port-0
bind or outgoing connection of another process can be handed it first; where the range is unknown or nothing is
free there, the kernel's pick."""

from __future__ import annotations

import socket

import pytest

from svc_common.free_port import _SPAN, ephemeral_low, free_port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_ports_are_free_and_below_the_given_ephemeral_range():
    ports = {free_port(low=40000) for _ in range(50)}
    assert all(40000 - _SPAN <= p < 40000 and _bindable(p) for p in ports)
    assert len(ports) > 40  # drawn at random, not handed out in sequence


def test_a_listening_port_is_never_returned(monkeypatch):
    monkeypatch.setattr("svc_common.free_port._SPAN", 4)  # 4 ports to draw from, one of them held
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        got = [free_port(low=port + 1) for _ in range(100)]
    assert port not in got


def test_the_kernels_range_is_read_and_an_unknown_one_falls_back_to_port_zero(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ephemeral_low(str(f)) == 32768
    assert ephemeral_low(str(tmp_path / "missing")) is None
    f.write_text("garbage")
    assert ephemeral_low(str(f)) is None
    assert _bindable(free_port(low=1024))  # no room below 1024: the kernel's pick


def test_on_linux_the_default_draw_avoids_the_ephemeral_range():
    low = ephemeral_low()
    if low is None or low <= 1024:
        pytest.skip("this machine names no ephemeral range with room below it")
    assert all(max(1024, low - _SPAN) <= free_port() < low for _ in range(20))
