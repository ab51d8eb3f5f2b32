"""ringweave's runtime: frames, connections, actors, the rendezvous store,
process groups and the launcher. It knows bytes, never arrays.

    import runtime
    rt = await runtime.init()          # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...
    world = rt.world                   # ProcessGroup: .rank, .size, .new_group(ranks)
    await runtime.shutdown()
"""

from runtime.errors import *  # noqa: F401,F403 - the typed errors are part of the API
from runtime.group import Call, ProcessGroup, Runtime
from runtime.init import current, init, read_env, shutdown, world

__all__ = ["init", "shutdown", "current", "world", "read_env", "Runtime", "ProcessGroup", "Call"]
