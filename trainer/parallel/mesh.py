"""Device meshes: the world's ranks as an n-dimensional array with named dimensions, a group per dimension.

What it is: torch's DeviceMesh over our `new_group`. ``DeviceMesh(world, (2, 2, 2), ("a", "b", "c"))``
lays the P ranks out as ``arange(P).reshape(2, 2, 2)`` (the last dimension fastest); the group along
a dimension holds the ranks that differ only in that coordinate, in index order (group rank ==
coordinate). ``mesh["c"]``: this rank's group along c; ``mesh["c", "a"]``: the sub-mesh of this
rank's slice, c then a, over the same groups; ``mesh.flatten(("a", "b"), "ab")``: one group over
a x b (row-major); ``coords``, ``coordinate(r)``, ``rank_of(a=1, b=0, c=1)``, ``members("b")``.

``Mesh(world, dp=, tp=, pp=, replicate=R)`` is the trainer's: axes pp x dp_replicate x dp_shard x tp,
dp flattened from the two dp axes; shape and coords show pp, dp, tp as always. R = 1: dp_shard is
the dp group, dp_replicate 1-rank groups. R > 1 is HSDP: shard over dp/R ranks, replicate over R.
A tp group, and a shard group with its tp peers, are contiguous ranks (one host under the
launcher); ``replicate="hosts"``: the fewest replicas whose shard groups each sit on one host.

Every rank makes every group, members or not, in one order (the axes fastest first, each in rank
order of its first member; each flatten as called; the embedding groups), as `new_group` requires;
a flattened dimension over one axis of size > 1 is that axis's groups. Making a group sends nothing.

Errors: sizes that do not multiply to the world, R that does not divide dp, a tp group across hosts
(its all-reduces must ride shared memory): a ValueError saying what to change. A lost rank fails
every group of the mesh, so a rank waiting in any dimension raises PeerLostError naming it.

What it is not: no re-meshing of a live job, no devices (ranks only). Worked examples and the HSDP
traffic: docs/design.md, "Model parallelism"; README.md, "Parallelism".
"""

from __future__ import annotations

import math

import numpy as np

from runtime.errors import PeerAbortedError, PeerLostError

__all__ = ["DeviceMesh", "Mesh", "AXES", "DIMS"]

AXES = ("pp", "dp_replicate", "dp_shard", "tp")  # the trainer's axes, outermost to innermost
DIMS = ("pp", "dp", "tp")  # what the trainer's shape and coords show: dp = dp_replicate x dp_shard


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mesh size {name} must be a positive integer, got {value!r}")
    return value


def _fibers(ranks: np.ndarray, axes: list[int]) -> np.ndarray:
    """One row per group spanning ``axes`` (indices into ranks' dimensions): the ranks that differ
    only in those coordinates, row-major over ``axes`` in the order given; rows in the row-major
    order of the other coordinates, so in rank order of their first member."""
    rest = [i for i in range(ranks.ndim) if i not in axes]
    return ranks.transpose(rest + axes).reshape(-1, math.prod(ranks.shape[i] for i in axes))


class DeviceMesh:
    """See the module docstring.

    Args:
        world: the world ProcessGroup (every rank of the job passes its own).
        shape: the size of each dimension, outermost first, e.g. (2, 4).
        names: a distinct name for each, e.g. ("dp", "tp").
    Raises:
        ValueError: sizes that are not positive or do not multiply to the world size; names that
            are not distinct strings, one per size.
    """

    def __init__(self, world, shape, names) -> None:
        names = tuple(names)
        if (len(names) != len(tuple(shape)) or len(set(names)) != len(names)
                or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"mesh names {names!r} must be distinct non-empty strings, one for each size of "
                             f"{tuple(shape)!r}")
        shape = tuple(_positive(n, s) for n, s in zip(names, shape))
        if math.prod(shape) != world.size:
            raise ValueError(f"mesh {' x '.join(f'{n}={s}' for n, s in zip(names, shape))} = {math.prod(shape)} "
                             f"ranks, but the world has {world.size}; the sizes must multiply to the world size")
        self._init_view(world, np.arange(world.size).reshape(shape), names, self)
        self._check()
        for name in reversed(names):  # every rank makes every group, in this order
            self._groups[name] = self._make(self.members(name))
        self._error: BaseException | None = None  # the loss that failed the mesh (see _on_lost)
        self._failure_listeners: list = []
        actor = getattr(getattr(world, "runtime", None), "actor", None)
        if actor is not None:
            actor.add_lost_listener(self._on_lost)

    def _init_view(self, world, ranks: np.ndarray, axes: tuple, root: "DeviceMesh") -> None:
        self.world = world
        self.ranks = ranks  # the world rank at each index of this mesh (an n-d integer array)
        self.axes = axes  # the names of ranks' dimensions, outermost first
        self.dims = axes  # the names shape, coords and describe show (the trainer's: pp, dp, tp)
        self._flat: dict[str, tuple[str, ...]] = {}  # a flattened name -> the axes it spans, in order
        self._groups: dict = {}  # name -> this rank's ProcessGroup along it
        self._extra: list = []  # groups of the mesh beyond its dimensions (the trainer's embedding group)
        self._root = root
        self._coords: tuple = (None, {})  # (the shown names, this rank's coordinates on them)

    def _check(self) -> None:
        """Refuses a layout before any group is made (the trainer's Mesh checks hosts here)."""

    def _make(self, rows) -> object:
        """Makes one group per row on every rank, in order; returns the one holding this rank."""
        mine = None
        for row in np.asarray(rows).tolist():
            group = self.world.new_group(row)
            if self.world.rank in row:
                mine = group
        return mine

    # ---- names, sizes and coordinates --------------------------------------------------

    def _axes_of(self, name: str) -> tuple[str, ...]:
        if name in self.axes:
            return (name,)
        if name in self._flat:
            return self._flat[name]
        raise KeyError(f"mesh dimension must be one of {self.axes + tuple(self._flat)}, got {name!r}")

    @property
    def size(self) -> int:
        """The number of ranks in this mesh."""
        return self.ranks.size

    @property
    def ndim(self) -> int:
        return self.ranks.ndim

    def dim_size(self, name: str) -> int:
        """The size of dimension ``name`` (an axis or a flattened one)."""
        return math.prod(self.ranks.shape[self.axes.index(a)] for a in self._axes_of(name))

    @property
    def shape(self) -> dict[str, int]:
        """{name: size} of the shown dimensions, e.g. {"pp": 2, "dp": 2, "tp": 2}."""
        return {d: self.dim_size(d) for d in self.dims}

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinates on the shown dimensions, e.g. {"pp": 1, "dp": 0, "tp": 1}."""
        if self._coords[0] != self.dims:  # worked out once per set of shown names
            self._coords = (self.dims, self.coordinate(self.world.rank))
        return dict(self._coords[1])

    def coordinate(self, rank: int, dims=None) -> dict[str, int]:
        """{name: index} of world rank ``rank`` on ``dims`` (default the shown ones); a flattened
        dimension's index is row-major over its axes."""
        found = np.argwhere(self.ranks == rank) if isinstance(rank, (int, np.integer)) else ()
        if len(found) != 1:
            raise ValueError(f"rank {rank} is not in this mesh (ranks {self.ranks.min()}..{self.ranks.max()})")
        index = dict(zip(self.axes, found[0].tolist()))
        out = {}
        for name in self.dims if dims is None else dims:
            axes = self._axes_of(name)
            sizes = [self.ranks.shape[self.axes.index(a)] for a in axes]
            out[name] = int(np.ravel_multi_index([index[a] for a in axes], sizes))
        return out

    def rank_of(self, **coords: int) -> int:
        """The world rank at these coordinates: every axis once, by name or through a flattened
        dimension, e.g. ``rank_of(pp=1, dp=1, tp=0)``."""
        index: dict[str, int] = {}
        for name, value in coords.items():
            axes, size = self._axes_of(name), self.dim_size(name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size:
                raise ValueError(f"{name}={value!r} is outside 0..{size - 1}")
            sizes = [self.ranks.shape[self.axes.index(a)] for a in axes]
            for axis, i in zip(axes, np.unravel_index(int(value), sizes)):
                if axis in index:
                    raise ValueError(f"rank_of: axis {axis!r} given twice in {coords}")
                index[axis] = int(i)
        missing = [a for a in self.axes if a not in index]
        if missing:
            raise ValueError(f"rank_of: no coordinate for {missing} in {coords}")
        return int(self.ranks[tuple(index[a] for a in self.axes)])

    def members(self, name: str) -> list[list[int]]:
        """Every group along ``name`` in this mesh, as world ranks in group-rank order."""
        return _fibers(self.ranks, [self.axes.index(a) for a in self._axes_of(name)]).tolist()

    def describe(self, rank: int | None = None) -> str:
        """e.g. "pp 1 dp 0 tp 1"."""
        c = self.coords if rank is None else self.coordinate(rank)
        return " ".join(f"{d} {c[d]}" for d in self.dims)

    def __repr__(self) -> str:
        """e.g. "Mesh(pp=1, dp=4 (dp_replicate=2 x dp_shard=2), tp=1; rank 5 at pp 0 dp 1 tp 0)"."""
        def size(d: str) -> str:
            wide = [f"{a}={self.dim_size(a)}" for a in self._axes_of(d) if self.dim_size(a) > 1]
            return f"{d}={self.dim_size(d)}" + (f" ({' x '.join(wide)})" if len(wide) > 1 else "")

        sizes = ", ".join(size(d) for d in self.dims)
        return f"{type(self).__name__}({sizes}; rank {self.world.rank} at {self.describe()})"

    # ---- groups, slicing and flattening ---------------------------------------------------

    def __getitem__(self, names):
        """``mesh["tp"]``: this rank's ProcessGroup along a dimension (its group rank is this rank's
        coordinate there). ``mesh["dp", "tp"]``: the sub-mesh of this rank's slice over those
        dimensions, in that order, sharing this mesh's groups."""
        if isinstance(names, str):
            self._axes_of(names)
            return self._groups[names]
        return self._slice(tuple(names))

    def _slice(self, names: tuple) -> "DeviceMesh":
        if not names or len(set(names)) != len(names):
            raise KeyError(f"a sub-mesh needs distinct dimension names, got {names!r}")
        spans = [self._axes_of(n) for n in names]
        used = [a for axes in spans for a in axes]
        if len(set(used)) != len(used):
            raise KeyError(f"dimensions {names!r} overlap (axes {used}); a sub-mesh needs each axis once")
        keep = [self.axes.index(a) for a in used]
        rest = [i for i in range(self.ndim) if i not in keep]
        mine = np.argwhere(self.ranks == self.world.rank)[0]
        ranks = self.ranks.transpose(rest + keep)[tuple(mine[i] for i in rest)]
        sub = object.__new__(DeviceMesh)
        sub._init_view(self.world, ranks.reshape([self.dim_size(n) for n in names]), names, self._root)
        sub._groups = {n: self._groups[n] for n in names}
        for flat, axes in self._flat.items():  # a flattened dimension inside the slice stays one
            if flat not in names and set(axes) <= set(names):
                sub._flat[flat], sub._groups[flat] = axes, self._groups[flat]
        return sub

    def flatten(self, names, name: str | None = None):
        """Makes ``name`` (default the names joined by "_") one dimension over ``names``, row-major
        in that order, as torch's ``mesh[names]._flatten(name)``; returns this rank's group along
        it. Every rank must flatten alike, in the same order (it makes groups). Flattening the
        same names under the same name again returns the same group.

        Raises:
            KeyError: an unknown or repeated dimension.
            ValueError: ``name`` is taken by another dimension.
        """
        names, root = tuple(names), self._root
        name = name or "_".join(names)
        axes = tuple(a for n in names for a in self._axes_of(n))  # this mesh's axes
        spans = tuple(x for a in axes for x in root._axes_of(a))  # the root's
        if not axes or len(set(spans)) != len(spans):
            raise KeyError(f"flatten needs distinct dimensions, got {names!r} (axes {spans})")
        if name in self.axes or name in root.axes or self._flat.get(name, axes) != axes \
                or root._flat.get(name, spans) != spans:
            raise ValueError(f"flatten: the name {name!r} is taken by another dimension of {self!r}")
        if name not in root._flat:  # every rank makes its groups here, in the order flatten is called
            wide = [a for a in spans if root.dim_size(a) > 1]
            if len(wide) <= 1:  # the same ranks as one axis's groups: the same groups
                root._groups[name] = root._groups[wide[0] if wide else spans[-1]]
            else:
                root._groups[name] = root._make(_fibers(root.ranks, [root.axes.index(a) for a in spans]))
            root._flat[name] = spans
        self._flat[name], self._groups[name] = axes, root._groups[name]
        return self._groups[name]

    def groups(self) -> list:
        """This rank's groups of the mesh, each once: the axes', the flattened ones', the rest."""
        out = []
        for group in [*self._root._groups.values(), *self._root._extra]:
            if group is not None and all(group is not g for g in out):
                out.append(group)
        return out

    # ---- failure ------------------------------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        """The loss that failed the mesh, once a rank of the job was lost (None before)."""
        return self._root._error

    def add_failure_listener(self, fn) -> None:
        """``fn(error)`` runs on the event loop when a rank of the job is lost (e.g. a strategy
        cancelling its point-to-point receives, which no group failure reaches)."""
        self._root._failure_listeners.append(fn)

    def _on_lost(self, peer: int, exc: BaseException) -> None:
        """A rank of the job was lost: every group of this rank's mesh fails with an error
        naming it (those that hold it are failed by the runtime already), then the listeners run."""
        if self._error is not None:
            return
        error = exc if isinstance(exc, PeerAbortedError) else PeerLostError(
            f"rank {peer} ({self.describe(peer) if 0 <= peer < self.world.size else '?'}) was lost; "
            f"the mesh stops every dimension of rank {self.world.rank} ({self.describe()}): {exc}", peer)
        self._error = error
        for group in self.groups():
            if group.error is None:
                group.abort(error, tell_peers=False)
        for fn in self._failure_listeners:
            fn(error)


class Mesh(DeviceMesh):
    """The trainer's mesh (the module docstring).

    Args:
        world: the world ProcessGroup (every rank of the job passes its own).
        dp, tp, pp: the sizes; dp=None takes what is left, world.size // (tp * pp).
        replicate: R replicas of the dp_shard groups (HSDP), dp = R x shard; "hosts": the fewest
            whose shard groups each sit on one host (1 where the hosts are not known).
        check_hosts: refuse tp groups that span hosts (when the runtime knows the hosts).
    Raises:
        ValueError: sizes that are not positive or do not multiply to the world size; R that does
            not divide dp; a tp group across hosts.
    """

    def __init__(self, world, *, dp: int | None = None, tp: int = 1, pp: int = 1, replicate: int | str = 1,
                 check_hosts: bool = True) -> None:
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
        nodes = getattr(getattr(world, "runtime", None), "nodes", None)
        if replicate == "hosts":
            replicate = _replicas_for_hosts(nodes, pp, dp, tp)
        replicate = _positive("replicate", replicate)
        if dp % replicate:
            raise ValueError(f"dp={dp} ranks do not split into replicate={replicate} replicas (HSDP: dp = "
                             f"replicas x shard ranks); choose a replica count that divides {dp}")
        self._nodes = nodes if check_hosts else None
        super().__init__(world, (pp, replicate, dp // replicate, tp), AXES)
        self.flatten(("dp_replicate", "dp_shard"), "dp")
        self.dims = DIMS
        self.embedding_group = None
        if pp > 1:  # the first and the last stage of each pipeline: [rank at pp 0, rank at pp - 1]
            self.embedding_group = self._make(self.ranks[[0, pp - 1]].reshape(2, -1).T)
            self._extra.append(self.embedding_group)

    def _check(self) -> None:
        nodes = self._nodes
        if nodes is None or len(set(nodes)) < 2 or self.dim_size("tp") == 1:
            return  # one host (or not known): every tp group shares memory
        for members in self.members("tp"):
            hosts = sorted({nodes[r] for r in members})
            if len(hosts) > 1:
                raise ValueError(f"tensor-parallel group {members} spans hosts {hosts}: tensor parallelism "
                                 f"all-reduces inside every layer and must stay on one host; choose --tp that "
                                 f"divides the ranks per host (the launcher puts contiguous ranks on a host)")


def _replicas_for_hosts(nodes, pp: int, dp: int, tp: int) -> int:
    """The fewest replicas R (a divisor of dp) for which every shard group with its tp peers, the
    rows of ``arange(P).reshape(pp * R, -1)``, lies on one host: 1 on one host or unknown hosts."""
    if nodes is None:
        return 1
    for r in (r for r in range(1, dp + 1) if dp % r == 0):
        blocks = np.arange(pp * dp * tp).reshape(pp * r, -1).tolist()
        if all(len({nodes[i] for i in row}) == 1 for row in blocks):
            return r
    return dp  # every block is a tp group: the tp check says why when even that spans hosts
