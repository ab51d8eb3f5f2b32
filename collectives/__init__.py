"""ringweave collectives (see collectives/api.py for the async calls, blocking.py for the facade).

    import collectives as C
    await C.all_reduce(x, op="sum")            # async, in place
    await C.all_gather_v(out, x, counts)       # a count per rank (uneven.py)
    value = await C.broadcast_object(obj)      # small Python values, msgpack (objects.py)
    src = await C.recv(x, src=None)            # point to point, from any rank (p2p.py)
    comm = C.Communicator.from_env()           # blocking, for code that is not asyncio

Names are loaded on first use, so importing a subpackage (collectives.kernels)
does not pull in the rest; ``runtime.init()`` loads them, off the event loop (warmup.py).
"""

from runtime import env as _env
from runtime import warmup as _warmup

_FROM = {  # public name -> the module that defines it
    **dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
                     "all_to_all", "barrier"), "api"),
    **dict.fromkeys(("send", "recv", "sendrecv", "probe", "iprobe", "Status"), "p2p"),
    **dict.fromkeys(("scan", "exscan"), "prefix"),
    **dict.fromkeys(("split", "new_subgroups"), "groups"),
    "monitored_barrier": "monitor",
    **dict.fromkeys(("all_gather_v", "all_to_all_v", "gather_v", "scatter_v"), "uneven"),
    **dict.fromkeys(("broadcast_object", "all_gather_object", "gather_object", "scatter_object"), "objects"),
    **dict.fromkeys(("Communicator", "Handle"), "blocking"),
}

__all__ = list(_FROM)


def _warm_up() -> None:
    """Run by ``runtime.init()`` on a worker thread, once per process (runtime/warmup.py)."""
    from collectives import warmup  # lazy: every algorithm and Numba, imported off the event loop
    warmup.warm()


async def _probe(rt) -> None:
    """Run by ``runtime.init()`` on every rank once joined: the tuner's probe where
    RINGWEAVE_TUNE_PROBE_S asks for it (collectives/tuneprobe.py)."""
    if _env.TUNE_PROBE.get() > 0:
        from collectives import tuneprobe  # lazy: only where the probe is asked for
        await tuneprobe.at_init(rt)


_warmup.add(_warm_up)  # before init() is the usual order: `import collectives` comes first
_warmup.on_join(_probe)

# The machinery behind these names, imported only from inside collectives/ (tests/tree/test_surfaces.py):
# choosing and opening a call, the host and device paths behind api.py, argument checks, shared
# sizes, the algorithms (one file each under algorithms/, reached through registry.ALGORITHMS) and
# the shared-memory slots they work on, and the warm-up. The other modules are public: api,
# blocking, p2p, uneven, tensors, objects, prefix, groups, monitor, bucket, compressed, compress,
# kernels, registry, comm (the Comm protocol an algorithm receives).
_INTERNAL = ("calls", "device", "device_pool", "ops", "tuning", "algorithms", "slots", "warmup")


def __dir__() -> list[str]:
    """The API (loaded on first use, so not yet in the module's globals) beside what is loaded."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    where = _FROM.get(name)
    if where is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    import importlib  # lazy: keeps `import collectives` free of any import but the first use's
    value = globals()[name] = getattr(importlib.import_module(f"collectives.{where}"), name)  # loaded once
    return value
