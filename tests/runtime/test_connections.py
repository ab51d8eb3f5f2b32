"""The connection conformance suite over both transports (in-memory and loopback TCP)."""

import pytest

from tests.conformance import check_connection

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("check", check_connection.ALL, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_connection_contract(check, transport):
    await check(transport)
