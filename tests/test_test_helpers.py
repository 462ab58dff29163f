"""The suite's own helpers where a mistake would show up as a flaky test elsewhere."""

from __future__ import annotations

import socket

from helpers import _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_outside_the_kernels_own_picks():
    """Ports the kernel hands to bind(0) can be taken between the pick and a rank's bind (the
    EADDRINUSE the gloo tests saw); drawn below the ephemeral range, only explicit picks can."""
    ports = free_ports(8)
    assert len(set(ports)) == 8
    low = _ephemeral_low()
    if low > 12_000:
        assert all(10_000 <= p < low for p in ports)
    held = []
    try:
        for port in ports:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))  # free now: each binds
    finally:
        for s in held:
            s.close()
