"""The tuner's probe at init: a short measurement where no rules file exists yet, shared by every rank.

Opt-in: ``RINGWEAVE_TUNE_PROBE_S=1.5`` (the same on every rank; default 0, never). Then
``runtime.init()`` (runtime/warmup.py ``on_join``) runs :func:`at_init` on every rank of a job
on one host, once joined:

1. **agree** whether to probe: every rank looks for the rules file of this machine and group size
   (collectives/tunefile.py), and the job probes where any rank lacks it (one all_reduce: a choice
   the ranks made apart could split them, one probing and one not, and deadlock);
2. **measure** (collectives/tune.py ``measure``, quick iterations): the model's terms, the compiled
   small shared-memory path on and off, streaming copies at :data:`STREAM_SIZES`, then the
   all_reduce's algorithms at :data:`GRID`, smallest first, starting no size once the slowest rank
   has spent the budget (an agreed figure, so all stop at the same size); the fitted lines carry
   the rules past the last size measured;
3. **share**: rank 0's rules, as JSON (never pickle), broadcast to every rank, checked and
   installed (``tunefile.install``): every rank ends with the same choices, whatever it measured
   itself;
4. **cache**: rank 0 writes them as the rules file (tunefile.save), so the next job on this machine
   with this group size loads them and does not probe; a file that cannot be written is one
   warning, and this job still uses the rules.

Why opt-in: a probe costs every job start its budget and measures whatever else runs at that
moment (a test suite starts hundreds of runtimes); ``python -m collectives.tune`` on a quiet
machine measures better. ``RINGWEAVE_TUNE=0`` turns the rules off, and the probe with them.
"""

from __future__ import annotations

import logging
import os

from collectives import registry, tune, tunefile
from runtime import env
from runtime.errors import PrivateDirError

__all__ = ["GRID", "STREAM_SIZES", "at_init"]

log = logging.getLogger("ringweave.tune")

GRID = (64, 64 << 10, 1 << 20, 4 << 20)  # all_reduce bench sizes: latency, the shm slot, bandwidth
STREAM_SIZES = (4 << 20, 16 << 20)  # streaming copies around the default threshold


async def at_init(rt) -> dict | None:
    """Steps 1-4 on ``rt``'s world; returns the rules file's content installed, or None (off, one
    rank, several hosts, or a rules file every rank has already)."""
    budget, p = env.TUNE_PROBE.get(), rt.world_size
    if budget <= 0 or p < 2 or not env.TUNE.get() or rt.world.topology.hosts != 1:
        return None
    key = tunefile.machine_key(p, 1, p)
    have = bool(env.TUNE_FILE.get()) or os.path.exists(tunefile.default_path(key))
    if not (await tune.agreed_max([0.0 if have else 1.0]))[0]:
        return None
    doc = await tune.measure(rt, ("all_reduce",), GRID, True, False, STREAM_SIZES, budget_s=budget)
    doc["command"] = f"RINGWEAVE_TUNE_PROBE_S={budget:g} (the probe at init)"
    doc = await tune.shared(rt, doc)
    tunefile.install(doc, p, registry.ALGORITHMS)
    registry.forget_choices()
    if rt.rank == 0 and not have:
        try:
            path = tunefile.save(doc, registry.ALGORITHMS)
            log.info("the probe at init wrote %s", path)
        except (OSError, PrivateDirError, ValueError) as exc:
            log.warning("the probe at init could not write its rules (%s); this job uses them all the same", exc)
    return doc
