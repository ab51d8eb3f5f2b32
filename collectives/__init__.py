"""ringweave collectives (see collectives/api.py for the async calls, blocking.py for the facade).

    import collectives as C
    await C.all_reduce(x, op="sum")            # async, in place
    comm = C.Communicator.from_env()           # blocking, for code that is not asyncio

Names are loaded on first use, so importing a subpackage (collectives.kernels)
does not pull in the rest.
"""

_API = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
        "all_to_all", "barrier", "send", "recv")

__all__ = list(_API) + ["Communicator", "Handle"]


def __getattr__(name):
    if name in _API:
        from collectives import api as module
    elif name in ("Communicator", "Handle"):
        from collectives import blocking as module
    else:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)  # loaded once: later lookups skip this function
    return value
