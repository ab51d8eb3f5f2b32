"""The device mesh: the world's ranks laid out as pp x dp x tp, with a process group per dimension.

What it is: torch's DeviceMesh shape over our `new_group`. The world of P ranks is the
array ``arange(P).reshape(pp, dp, tp)``; a rank's coordinates are its indices in it:

    rank = (pp_index * dp + dp_index) * tp + tp_index          # tp varies fastest

so the ranks of one tensor-parallel group are contiguous (on one host under the launcher's
layout, where shared memory carries their all-reduces), a data-parallel group strides by tp,
and a pipeline group by dp * tp. Worked example, 8 ranks, pp=2 dp=2 tp=2:

    pp 0:  dp 0: [0 1]   dp 1: [2 3]         tp groups   [0,1] [2,3] [4,5] [6,7]
    pp 1:  dp 0: [4 5]   dp 1: [6 7]         dp groups   [0,2] [1,3] [4,6] [5,7]
                                             pp groups   [0,4] [1,5] [2,6] [3,7]
                                             embedding   [0,4] [1,5] [2,6] [3,7]  (first + last stage)

    mesh = Mesh(world, tp=2, pp=2)           # dp defaults to what is left: 8 / (2 * 2) = 2
    mesh["tp"]                               # this rank's tp ProcessGroup (group rank == tp index)
    mesh.coords                              # {"pp": 1, "dp": 0, "tp": 1} on rank 5
    mesh.coordinate(6), mesh.rank_of(pp=1, dp=1, tp=0)     # {"pp": 1, "dp": 1, "tp": 0}, 6
    mesh.embedding_group                     # first and last stage of this rank's pipeline (pp > 1)

Every rank creates every group, members or not, in one order (tp groups, then dp, then pp,
then embedding, each in rank order of their first member), as `new_group` requires. Making
a group sends nothing.

Errors: sizes that do not multiply to the world size, and tensor-parallel groups that would
span hosts when the job does (tensor parallelism all-reduces inside every layer: it must
ride shared memory, not the network), are a ValueError that says what to change. Whether a
model divides (heads, widths, layers per stage) is checked where the model is split
(trainer/parallel/gpt.py, pipeline.py).

A lost rank: the runtime fails every group that holds it; the mesh also fails every one of
ITS groups (a tp group does not hold a lost pp peer, yet its ranks must stop too), so a
rank waiting in any dimension raises PeerLostError naming the lost rank within seconds.

What it is not: no hybrid-sharding or context-parallel dimensions, no re-meshing of a live job.
"""

from __future__ import annotations

from runtime.errors import PeerAbortedError, PeerLostError

__all__ = ["Mesh", "DIMS"]

DIMS = ("pp", "dp", "tp")  # outermost to innermost: the order of the mesh's axes


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mesh size {name} must be a positive integer, got {value!r}")
    return value


class Mesh:
    """See the module docstring.

    Args:
        world: the world ProcessGroup (every rank of the job passes its own).
        dp, tp, pp: the sizes; dp=None takes what is left, world.size // (tp * pp).
        check_hosts: refuse tp groups that span hosts (when the runtime knows the hosts).
    Raises:
        ValueError: sizes that are not positive or do not multiply to the world size; a tp
            group across hosts.
    """

    def __init__(self, world, *, dp: int | None = None, tp: int = 1, pp: int = 1, check_hosts: bool = True) -> None:
        tp, pp = _positive("tp", tp), _positive("pp", pp)
        P = world.size
        if dp is None:
            if P % (tp * pp):
                raise ValueError(f"the world of {P} ranks does not divide into tp={tp} x pp={pp} "
                                 f"(tp * pp = {tp * pp}); choose sizes whose product divides {P}")
            dp = P // (tp * pp)
        dp = _positive("dp", dp)
        if dp * tp * pp != P:
            raise ValueError(f"mesh dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but the world has {P}; "
                             f"the sizes must multiply to the world size")
        self.world = world
        self.shape = {"pp": pp, "dp": dp, "tp": tp}
        self.coords = self.coordinate(world.rank)
        self._groups = {}
        for dim in ("tp", "dp", "pp"):  # every rank makes every group, in this order
            for members in self._all_groups(dim):
                group = world.new_group(members)
                if world.rank in members:
                    self._groups[dim] = group
        self.embedding_group = None
        if pp > 1:
            for dp_index in range(dp):
                for tp_index in range(tp):
                    members = [self.rank_of(pp=0, dp=dp_index, tp=tp_index),
                               self.rank_of(pp=pp - 1, dp=dp_index, tp=tp_index)]
                    group = world.new_group(members)
                    if world.rank in members:
                        self.embedding_group = group
        if check_hosts:
            self._check_tp_hosts()
        self.error: BaseException | None = None  # the loss that failed the mesh (see _on_lost)
        self._failure_listeners: list = []
        actor = getattr(getattr(world, "runtime", None), "actor", None)
        if actor is not None:
            actor.add_lost_listener(self._on_lost)

    # ---- coordinates ------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self.world.size

    def dim_size(self, dim: str) -> int:
        return self.shape[self._check_dim(dim)]

    def coordinate(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "tp": k} of world rank ``rank``."""
        if not 0 <= rank < self.world.size:
            raise ValueError(f"rank {rank} is outside the world 0..{self.world.size - 1}")
        dp, tp = self.shape["dp"], self.shape["tp"]
        return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}

    def rank_of(self, *, pp: int, dp: int, tp: int) -> int:
        """The world rank at these coordinates."""
        for name, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= value < self.shape[name]:
                raise ValueError(f"{name}={value} is outside 0..{self.shape[name] - 1}")
        return (pp * self.shape["dp"] + dp) * self.shape["tp"] + tp

    def _check_dim(self, dim: str) -> str:
        if dim not in DIMS:
            raise KeyError(f"mesh dimension must be one of {DIMS}, got {dim!r}")
        return dim

    def __getitem__(self, dim: str):
        """This rank's ProcessGroup along ``dim`` ("dp" | "tp" | "pp"); its group rank is
        this rank's coordinate on that dimension."""
        return self._groups[self._check_dim(dim)]

    def _all_groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``: the world ranks that differ only in that coordinate."""
        others = [d for d in DIMS if d != dim]
        out = []
        for a in range(self.shape[others[0]]):
            for b in range(self.shape[others[1]]):
                fixed = {others[0]: a, others[1]: b}
                out.append([self.rank_of(**fixed, **{dim: i}) for i in range(self.shape[dim])])
        return sorted(out)

    def describe(self, rank: int | None = None) -> str:
        """e.g. "pp 1 dp 0 tp 1"."""
        c = self.coords if rank is None else self.coordinate(rank)
        return " ".join(f"{d} {c[d]}" for d in DIMS)

    def __repr__(self) -> str:
        return (f"Mesh(pp={self.shape['pp']}, dp={self.shape['dp']}, tp={self.shape['tp']}; "
                f"rank {self.world.rank} at {self.describe()})")

    # ---- checks and failure --------------------------------------------------------------

    def _check_tp_hosts(self) -> None:
        nodes = getattr(getattr(self.world, "runtime", None), "nodes", None)
        if nodes is None or len(set(nodes)) < 2 or self.shape["tp"] == 1:
            return  # one host (or not known): every tp group shares memory
        for members in self._all_groups("tp"):
            hosts = sorted({nodes[r] for r in members})
            if len(hosts) > 1:
                raise ValueError(f"tensor-parallel group {members} spans hosts {hosts}: tensor parallelism "
                                 f"all-reduces inside every layer and must stay on one host; choose --tp that "
                                 f"divides the ranks per host (the launcher puts contiguous ranks on a host)")

    def groups(self) -> list:
        """This rank's groups of the mesh (tp, dp, pp and the embedding group if any)."""
        out = [self._groups[d] for d in ("tp", "dp", "pp")]
        return out + ([self.embedding_group] if self.embedding_group is not None else [])

    def add_failure_listener(self, fn) -> None:
        """``fn(error)`` runs on the event loop when a rank of the job is lost (e.g. a strategy
        cancelling its point-to-point receives, which no group failure reaches)."""
        self._failure_listeners.append(fn)

    def _on_lost(self, peer: int, exc: BaseException) -> None:
        """A rank of the job was lost: every group of this rank's mesh fails with an error
        naming it (those that hold it are failed by the runtime already), then the listeners run."""
        if self.error is not None:
            return
        error = exc if isinstance(exc, PeerAbortedError) else PeerLostError(
            f"rank {peer} ({self.describe(peer) if 0 <= peer < self.world.size else '?'}) was lost; "
            f"the mesh stops every dimension of rank {self.world.rank} ({self.describe()}): {exc}", peer)
        self.error = error
        for group in self.groups():
            if group.error is None:
                group.abort(error, tell_peers=False)
        for fn in self._failure_listeners:
            fn(error)
