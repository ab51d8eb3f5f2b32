"""ringweave's runtime: frames, connections, actors, the rendezvous store,
process groups and the launcher. It knows bytes, never arrays.

    import runtime
    rt = await runtime.init()          # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...
    world = rt.world                   # ProcessGroup: .rank, .size, .new_group(ranks)
    await runtime.shutdown()           # in a `finally:`: aborts the job if an exception is unwinding
    await runtime.abort(exc)           # leave at once because of exc: every peer raises PeerAbortedError

    runtime.run(main())                # asyncio.run (uvloop's when installed); an exception that
                                       # escapes main() aborts the job: peers raise PeerAbortedError
"""

import asyncio

from runtime.errors import *  # noqa: F401,F403 - the typed errors are part of the API
from runtime.group import Call, ProcessGroup
from runtime.rankruntime import RankRuntime
from runtime.init import abort, abort_reason, current, init, read_env, shutdown, world



def run(main, *, debug: bool | None = None):
    """Runs coroutine ``main`` to completion on a new event loop: uvloop's when
    installed (faster sockets), asyncio's otherwise. Returns its result.

    An exception that escapes ``main`` while this rank's runtime is open aborts the job
    (:func:`abort`) before it propagates: every peer raises :class:`PeerAbortedError` naming
    this rank and the exception, and the launcher names this rank as the one that failed,
    as with ``try: ... finally: await runtime.shutdown()``. Cancellation (Ctrl-C) does not."""
    if not asyncio.iscoroutine(main):
        raise ValueError(f"a coroutine was expected, got {main!r}")
    try:
        import uvloop  # lazy: an optional dependency (Linux only)
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        return asyncio.run(_aborting_on_error(main), debug=debug)
    return uvloop.run(_aborting_on_error(main), debug=debug)


async def _aborting_on_error(main):
    """``await main``; what escapes it aborts the runtime it left open (abort_reason says
    which exits are orderly: SystemExit(0), and cancellation here)."""
    try:
        return await main
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if abort_reason(exc) is not None:
            await abort(exc)
        raise


__all__ = ["run", "init", "shutdown", "abort", "current", "world", "read_env", "RankRuntime", "ProcessGroup", "Call"]
# Imported only from inside runtime/ (tests/tree/test_surfaces.py): the listener's accept loop,
# child processes, the launcher's command line and decisions, what a scheduler (SLURM, mpirun)
# tells the launcher and init, and the store's frames.
_INTERNAL = ("acceptor", "launch_config", "launch_outcome", "procs", "scheduler", "store_protocol")
