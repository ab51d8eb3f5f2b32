"""RINGWEAVE_HOST: the address a rank advertises to its peers through the store
(``runtime.init._advertised_host``), in place of the address of this host that
routes to MASTER_ADDR.

``init`` asks for the advertised address only when MASTER_ADDR is not loopback
(a one-machine job advertises 127.0.0.1 whatever the variable says), and these
tests use loopback addresses only, so they test the function that reads the
variable and what peers do with its answer, not ``init`` end to end. The
reference is the routed address: 127.0.0.1 for a master on 127.0.0.1. The
override is 127.0.0.2, also loopback on Linux but a different address.
"""

import asyncio
import sys

import pytest

from runtime.actor import Actor
from runtime.init import _advertised_host

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.2 is loopback on Linux only"),
]
MASTER = "127.0.0.1"
OVERRIDE = "127.0.0.2"


def test_without_the_variable_the_routed_address_is_advertised(monkeypatch):
    monkeypatch.delenv("RINGWEAVE_HOST", raising=False)
    assert _advertised_host(MASTER) == "127.0.0.1"
    monkeypatch.setenv("RINGWEAVE_HOST", "")  # set but empty: as if unset
    assert _advertised_host(MASTER) == "127.0.0.1"


def test_the_variable_overrides_the_routed_address(monkeypatch):
    monkeypatch.setenv("RINGWEAVE_HOST", OVERRIDE)
    assert _advertised_host(MASTER) == OVERRIDE


async def test_peers_reach_a_rank_at_the_address_the_variable_names(monkeypatch):
    """Rank 0 listens on 127.0.0.2 only (a node that must be reached at that address) and
    advertises what RINGWEAVE_HOST says; rank 1 dials the advertised address. Without the
    variable rank 0 would advertise 127.0.0.1, where nothing listens on its port."""
    monkeypatch.setenv("RINGWEAVE_HOST", OVERRIDE)
    actors = [Actor(0, 2, job="test"), Actor(1, 2, job="test")]
    try:
        _, port0 = await actors[0].listen(OVERRIDE, 0)
        _, port1 = await actors[1].listen("127.0.0.1", 0)
        addresses = {0: (_advertised_host(MASTER), port0), 1: ("127.0.0.1", port1)}  # as published in the store
        await asyncio.gather(*(a.connect_peers(addresses, 3.0) for a in actors))
        assert actors[1].conns[0].where == f"rank 0 at {OVERRIDE}:{port0}"
        await actors[1].send(0, "t", {"from": 1})
        assert await actors[0].recv(1, "t", timeout_s=5.0) == {"from": 1}
    finally:
        for a in actors:
            await a.close()
