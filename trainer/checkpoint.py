"""Sharded, atomic checkpoints; loading onto any world size and strategy; full-parameter export.

What it is. A checkpoint is a directory ``root/step-SSSSSSSS``: every rank writes its pieces of
each unit's unpadded flat arrays (parameters, optimizer state) and rank 0 one ``metadata.json``
with the global layout, the step, the optimizer, the loss scaler, the loop's ``extra``, the
model's spec and the run it belongs to (trainer/runid.py). A save is written under
``.tmp-step-S`` and renamed only when every rank's pieces are durable, so a crash leaves the
previous checkpoint the newest; a failure on any rank is a CheckpointError on every rank. Loading
cuts each rank's ranges from the pieces (memory-mapped): that is the resharding onto another world
size, strategy or mesh.

    path = await save(strategy, "ckpt", extra={"epoch": 1, "batch": 12}, run=run)  # every rank
    meta = await load_newest_valid(strategy, "ckpt")   # the newest that loads on every rank, or None
    params = read_full_params(latest("ckpt"))           # {name: array}, one process, no group

Every file is reached through checked directory descriptors (trainer/ckptfs.py) and a checkpoint
is untrusted input, its metadata checked against trainer/ckptschema.py before anything is
allocated (SECURITY.md, "Checkpoints"); a damaged one is skipped by :func:`load_newest_valid`.
Ranks must share the file system. The metadata, the save's steps and resuming: docs/design.md,
"Checkpoints".

What it is not: no asynchronous (background) saving, no object-store backends, no choice of which
run a directory continues (trainer/rundir.py).
"""

from __future__ import annotations

import json
import logging
import stat
import time
import zlib
from pathlib import Path

import numpy as np

from runtime.errors import ranks_in_words
from trainer import ckptfs, runid
from trainer.ckptfs import Dir, remove_checkpoint
from trainer.ckptschema import FORMAT, METADATA, VERSION, CheckpointError, validate
from trainer.precision import resolve_dtype

log = logging.getLogger("ringweave.checkpoint")

__all__ = ["CheckpointError", "step_dir_name", "save", "load", "load_newest_valid", "latest", "list_checkpoints",
           "read_metadata", "read_full_params", "read_unit_params", "export_npz", "export_npz_from_checkpoint",
           "remove_checkpoint"]

# ---- helpers ----------------------------------------------------------------------


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8)) & 0xFFFFFFFF


def step_dir_name(step: int) -> str:
    """The directory of the checkpoint of ``step``, e.g. "step-00000046"."""
    return f"step-{step:08d}"


async def _all_reduce_sum(strategy, values: np.ndarray) -> np.ndarray:
    """Sum over the strategy's group (a barrier too); free at world size 1."""
    if strategy.group.size > 1:
        import collectives

        await collectives.all_reduce(values, op="sum", group=strategy.group)
    return values


# ---- save -------------------------------------------------------------------------


def _write_pieces(state: dict, tmp: Dir, rank: int) -> dict:
    """Writes this rank's pieces into tmp/rankRRRRR/ (0700, files 0600, O_EXCL); returns
    {name: piece} for the index."""
    rank_name = f"rank{rank:05d}"
    pieces = {}
    with tmp.make(rank_name) as rank_dir:
        for name, shard in state["shards"].items():
            lay = state["layout"][name]
            if lay["replicated"] and rank != 0:
                continue  # written once, by rank 0
            shard = np.ascontiguousarray(shard)
            if shard.size == 0:
                continue  # a shard wholly inside the padding
            rank_dir.write_new(f"{name}.npy", lambda f, a=shard: np.save(f, a, allow_pickle=False))
            pieces[name] = {"file": f"{rank_name}/{name}.npy", "start": int(lay["start"]),
                            "stop": int(lay["start"]) + int(shard.size), "crc32": _crc(shard),
                            "numel": int(lay["numel"]), "dtype": shard.dtype.name}
        rank_dir.write_new("index.json", lambda f: f.write(json.dumps({"rank": rank, "pieces": pieces}).encode()))
        rank_dir.fsync()
    return pieces


def _metadata(state: dict, model, tmp: Dir, world: int, extra: dict | None, run: dict | None) -> dict:
    model_units = model.units
    arrays: dict[str, dict] = {}
    for r in range(world):
        index = tmp.read_json(f"rank{r:05d}/index.json")
        for name, piece in index["pieces"].items():
            entry = arrays.setdefault(name, {"numel": piece["numel"], "dtype": piece["dtype"], "pieces": []})
            entry["pieces"].append({k: piece[k] for k in ("file", "start", "stop", "crc32")})
    for name, lay in state["layout"].items():  # arrays of numel 0 have no pieces but still exist
        arrays.setdefault(name, {"numel": int(lay["numel"]), "dtype": np.asarray(state["shards"][name]).dtype.name,
                                 "pieces": []})
    for entry in arrays.values():
        entry["pieces"].sort(key=lambda p: p["start"])
    units = [{"index": i, "numel": u.numel,
              "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in u.param_specs]}
             for i, u in enumerate(model_units)]
    meta = {"format": FORMAT, "version": VERSION, "step": int(state["step"]), "optim_step": int(state["optim_step"]),
            "strategy": state["strategy"], "world_size": world, "optimizer": state["optimizer"],
            "master_dtype": state["master_dtype"], "scaler": state["scaler"], "extra": extra or {},
            "created_unix_s": time.time(), "units": units, "arrays": arrays,
            "model": model.spec() if hasattr(model, "spec") else None, "mesh": state.get("mesh")}
    if run is not None:
        meta["run"] = {"id": run["id"], "config": dict(run["config"])}
    return meta


def _own_checkpoints(root: Path, run_id: str | None) -> list[Path]:
    """The committed checkpoints under ``root`` that run ``run_id`` wrote (None: those that name
    no run), oldest first; one whose metadata cannot be read is nobody's."""
    own = []
    for path in list_checkpoints(root):
        try:
            if runid.run_of(read_metadata(path)) == run_id:
                own.append(path)
        except (CheckpointError, ValueError):
            continue
    return own


def _prepare(root: Path, tmp_name: str) -> tuple[Dir, Dir]:
    """Rank 0: the root (made 0700 if missing, checked), its stale temporary directories removed,
    and a fresh ``tmp_name`` in it."""
    rootdir = ckptfs.open_root(root, create=True)
    try:
        for stale in rootdir.names():
            if ckptfs.TMP.match(stale):
                remove_checkpoint(rootdir, stale)
        return rootdir, rootdir.make(tmp_name)
    except BaseException:
        rootdir.close()
        raise


def _open_tmp(root: Path, tmp_name: str) -> tuple[Dir, Dir]:
    """Ranks but 0: the root and the temporary directory rank 0 made, each checked."""
    rootdir = ckptfs.open_root(root)
    if rootdir is None:
        raise CheckpointError(f"{root} is missing (rank 0 made it: do the ranks share one file system?)")
    try:
        return rootdir, rootdir.sub(tmp_name)
    except BaseException:
        rootdir.close()
        raise


def _commit(meta: dict, rootdir: Dir, tmp: Dir, tmp_name: str, name: str) -> None:
    """Rank 0: metadata.json (checked as a reader will check it), then the rename of ``tmp_name``
    to ``name`` once it is sure the directory there is still the one it made."""
    text = json.dumps(meta, indent=1)
    try:
        validate(json.loads(text))  # nothing is written that a reader would refuse
    except CheckpointError as exc:
        raise CheckpointError(f"the metadata of {name} would not load back: {exc}") from None
    tmp.write_new(METADATA, lambda f: f.write(text.encode()))
    tmp.fsync()
    if not rootdir.holds(tmp, tmp_name):
        raise CheckpointError(f"{rootdir.path / tmp_name} was replaced while saving; not committed")
    if rootdir.lstat(name) is not None:  # the same step saved again: replace it
        old = f".tmp-old-{name}"
        rootdir.replace(name, old)
        rootdir.replace(tmp_name, name)
        remove_checkpoint(rootdir, old)
    else:
        rootdir.replace(tmp_name, name)
    rootdir.fsync()


async def save(strategy, root, *, extra: dict | None = None, keep_last: int = 3, run: dict | None = None,
               protected: tuple[str, ...] = ()) -> Path:
    """Saves ``strategy``'s state under ``root/step-SSSSSSSS``; every rank of its group calls it.

    Args:
        strategy: a set-up Strategy (has ``group``, ``model``, ``state_dict()``).
        root: the checkpoint directory (made 0700 if missing; an existing one must be this
            user's and not writable by others), the same path on every rank.
        extra: JSON-able loop state, e.g. ``{"epoch": 2, "batch": 7}``.
        keep_last: committed checkpoints of this run kept (its older ones are deleted), >= 1.
        protected: names of step directories never deleted by that pruning, e.g. ("step-00000046",),
            the best checkpoint that ``fit(save_best=...)`` keeps beside the newest ones.
        run: ``{"id": 32 lowercase hex, "config": {name: JSON scalar or list of scalars}}``, the run
            this checkpoint belongs to (trainer/runid.py), stored as metadata["run"]; None: none.
    Returns:
        The committed checkpoint's directory.
    Raises:
        CheckpointError: on every rank, naming the ranks whose write failed (or the root that
            is not safely ours); the previous checkpoints are untouched.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if run is not None:
        runid.check_run(run)
    root = Path(root)
    group = strategy.group
    rank, world = group.rank, group.size
    # a mesh strategy gathers its arrays into the full model's layout first (collective)
    gather = getattr(strategy, "sharded_state_dict", None)
    state = await gather() if gather is not None else strategy.state_dict()
    name = step_dir_name(int(state["step"]))
    tmp_name = f".tmp-{name}"
    tmp_path, final = root / tmp_name, root / name
    rootdir = tmp = None
    try:
        # 1. rank 0 prepares an empty temporary directory
        failed = np.zeros(world, dtype=np.float64)
        if rank == 0:
            try:
                rootdir, tmp = _prepare(root, tmp_name)
            except (OSError, CheckpointError) as exc:
                failed[0] = 1
                prepare_error = exc
        await _all_reduce_sum(strategy, failed)
        if failed[0]:
            raise CheckpointError(f"save to {root}: rank 0 could not prepare {tmp_path}"
                                  + (f": {prepare_error}" if rank == 0 else ""))
        # 2. every rank writes its pieces
        error = None
        try:
            if rank != 0:
                rootdir, tmp = _open_tmp(root, tmp_name)
            _write_pieces(state, tmp, rank)
        except Exception as exc:  # reported to every rank below, never left to hang them
            error = exc
            failed[rank] = 1
        # 3. agree on failures
        await _all_reduce_sum(strategy, failed)
        bad = [r for r in range(world) if failed[r]]
        if bad:
            if rank == 0:
                remove_checkpoint(rootdir, tmp_name)
            raise CheckpointError(f"save of {name} to {root} failed on {ranks_in_words(bad)}; the previous checkpoint is "
                                  f"intact" + (f" (this rank: {error!r})" if error else "")) from error
        # 4. rank 0 commits
        commit = np.zeros(1, dtype=np.float64)
        if rank == 0:
            try:
                meta = _metadata(state, getattr(strategy, "logical_model", strategy.model), tmp, world, extra, run)
                _commit(meta, rootdir, tmp, tmp_name, name)
                for stale in _own_checkpoints(root, run["id"] if run else None)[:-keep_last]:
                    if stale.name not in protected:
                        remove_checkpoint(rootdir, stale.name)
            except Exception as exc:
                commit[0] = 1
                error = exc
        # 5. nobody returns before the commit is known
        await _all_reduce_sum(strategy, commit)
        if commit[0]:
            raise CheckpointError(f"commit of {name} in {root} failed on rank 0"
                                  + (f": {error!r}" if error else "")) from error
    finally:
        for d in (tmp, rootdir):
            if d is not None:
                d.close()
    return final


# ---- finding and reading ---------------------------------------------------------


def _committed(root: Dir) -> list[str]:
    """Names of the committed checkpoints of an open root, oldest first."""
    return [name for _, name in ckptfs.step_names(root)
            if (st := root.lstat(f"{name}/{METADATA}")) is not None and stat.S_ISREG(st.st_mode)]


def list_checkpoints(root) -> list[Path]:
    """Committed checkpoints under ``root``, oldest first (temporary directories are ignored).

    Raises:
        CheckpointError: ``root`` is not safely this user's (ckptfs.open_root).
    """
    root = Path(root)
    rootdir = ckptfs.open_root(root) if root.is_dir() else None
    if rootdir is None:
        return []
    with rootdir:
        return [root / name for name in _committed(rootdir)]


def latest(root) -> Path | None:
    """The newest committed checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _open_checkpoint(path) -> Dir:
    """The checkpoint directory ``path``, or the newest one under the root ``path``, opened and
    checked (the caller closes it)."""
    path = Path(path)
    try:
        d = ckptfs.open_dir(path)
    except FileNotFoundError:
        raise CheckpointError(f"no committed checkpoint in {path}: it does not exist") from None
    if d.lstat(METADATA) is not None:
        return d
    with d:
        found = _committed(d)
        if not found:
            raise CheckpointError(f"no committed checkpoint in {path} (looked for {METADATA} or step-*/{METADATA})")
        return d.sub(found[-1])


def _read_meta(ckpt: Dir) -> dict:
    """The validated metadata of an open checkpoint, with "path" added."""
    meta = ckpt.read_json(METADATA)
    try:
        validate(meta)
    except CheckpointError as exc:
        raise CheckpointError(f"{ckpt.path / METADATA}: {exc}") from None
    meta["path"] = str(ckpt.path)
    return meta


def read_metadata(path) -> dict:
    """The metadata of a checkpoint directory (or of the newest one under a root), validated
    (trainer/ckptschema.py)."""
    with _open_checkpoint(path) as ckpt:
        return _read_meta(ckpt)


def _read_range(ckpt: Dir, name: str, entry: dict, lo: int, hi: int, dtype) -> np.ndarray:
    """Elements [lo, hi) of array ``name``, assembled from the pieces that overlap them. Every
    such piece's file is checked to hold its elements before the result is allocated."""
    if not 0 <= lo <= hi <= entry["numel"]:
        raise CheckpointError(f"{ckpt.path}: {name!r} has {entry['numel']} elements; [{lo}, {hi}) was asked for")
    stored = resolve_dtype(entry["dtype"])
    pieces = [p for p in entry["pieces"] if max(lo, p["start"]) < min(hi, p["stop"])]
    offsets = [ckptfs.npy_offset(ckpt, p["file"], stored, p["stop"] - p["start"], name) for p in pieces]
    covered = sum(min(hi, p["stop"]) - max(lo, p["start"]) for p in pieces)
    if covered != hi - lo:
        raise CheckpointError(f"{ckpt.path}: pieces of {name!r} cover {covered} of the {hi - lo} elements "
                              f"[{lo}, {hi}) this rank needs")
    out = np.empty(hi - lo, dtype=dtype)  # no larger than what the checked files hold
    for piece, offset in zip(pieces, offsets):
        data = ckptfs.map_npy(ckpt, piece["file"], stored, piece["stop"] - piece["start"], offset)
        if _crc(data) != piece["crc32"]:
            raise CheckpointError(f"{ckpt.path / piece['file']} ({name}) is corrupt: its checksum differs from "
                                  f"{METADATA}")
        a, b = max(lo, piece["start"]), min(hi, piece["stop"])
        out[a - lo : b - lo] = data[a - piece["start"] : b - piece["start"]]
    return out


def _load(strategy, ckpt: Dir) -> dict:
    meta = _read_meta(ckpt)
    want = strategy.state_dict()
    shards = {}
    for name, lay in want["layout"].items():
        entry = meta["arrays"].get(name)
        if entry is None:
            raise CheckpointError(f"{ckpt.path}: no array {name!r} (saved with optimizer {meta['optimizer']!r} and "
                                  f"{len(meta['units'])} units; this run uses {want['optimizer']!r} and "
                                  f"{len(strategy.model.units)} units)")
        if entry["numel"] != lay["numel"]:
            raise CheckpointError(f"{ckpt.path}: {name!r} has {entry['numel']} elements, the model's has "
                                  f"{lay['numel']}")
        n, dtype = len(want["shards"][name]), np.asarray(want["shards"][name]).dtype
        if "index" in lay:  # scattered elements (a tensor-parallel cut): the range around them, then a take
            index = np.asarray(lay["index"], dtype=np.int64)
            lo, hi = (int(index.min()), int(index.max()) + 1) if index.size else (0, 0)
            shards[name] = _read_range(ckpt, name, entry, lo, hi, dtype)[index - lo]
        else:
            shards[name] = _read_range(ckpt, name, entry, lay["start"], lay["start"] + n, dtype)
    try:
        strategy.load_state_dict({**want, "shards": shards, "step": meta["step"], "optim_step": meta["optim_step"],
                                  "scaler": meta["scaler"]})
    except ValueError as exc:
        raise CheckpointError(f"{ckpt.path}: {exc}") from None
    return meta


def load(strategy, path) -> dict:
    """Loads a checkpoint into a set-up ``strategy`` of any world size and strategy; returns the metadata.

    ``path`` is a checkpoint directory or a root (its newest checkpoint is used).
    Local: no collective runs here (parameters that must be re-gathered are, at
    the strategy's next async call). ``metadata["extra"]`` is what ``save`` got.

    Raises:
        CheckpointError: nothing committed there, metadata that breaks the schema, a missing,
            foreign or corrupt piece, or a layout that does not match the model (names the array).
    """
    with _open_checkpoint(path) as ckpt:
        return _load(strategy, ckpt)


def _try_load(strategy, rootdir: Dir, name: str) -> dict:
    """Loads checkpoint ``name`` of an open root; any failure to read it is a CheckpointError."""
    try:
        with rootdir.sub(name) as ckpt:
            return _load(strategy, ckpt)
    except FileNotFoundError:
        raise CheckpointError(f"{rootdir.path / name} is gone") from None
    except OSError as exc:  # an I/O error reading it: the one before may be intact
        raise CheckpointError(f"{rootdir.path / name}: {exc}") from None


async def load_newest_valid(strategy, root, candidates=None) -> dict | None:
    """Loads the newest checkpoint under ``root`` that loads and verifies on every rank; returns
    its metadata, or None when ``root`` holds no committed checkpoint. ``candidates``: the
    checkpoint directories under ``root`` to try instead of all of root's, oldest first (the same
    list on every rank: one run's, trainer/rundir.py). A collective over the
    strategy's group: every rank tries the same checkpoints in the same order (newest first) and
    they agree, after each, whether all succeeded (an all_reduce of the failures), so all end on
    the same one. Each one skipped is logged with why (damaged, foreign, against the schema).

    Raises:
        CheckpointError: there are checkpoints, and none loads (names each and why); or
            ``root`` itself is not safely this user's.
    """
    root = Path(root)
    rootdir = ckptfs.open_root(root) if root.is_dir() else None
    if rootdir is None:
        return None
    with rootdir:
        found = _committed(rootdir) if candidates is None else [Path(p).name for p in candidates]
        skipped = []
        for name in reversed(found):
            try:
                meta, error = _try_load(strategy, rootdir, name), None
            except CheckpointError as exc:
                meta, error = None, exc
            failed = await _all_reduce_sum(strategy, np.array([0.0 if error is None else 1.0]))
            if failed[0] == 0:
                if skipped:
                    log.warning("resuming from %s: the newer %s could not be loaded", root / name, ", ".join(skipped))
                return meta
            why = error if error is not None else f"{int(failed[0])} other rank(s) could not load it"
            log.warning("checkpoint %s cannot be loaded (%s); trying the one before", root / name, why)
            skipped.append(f"{name} ({why})")
    if found:
        raise CheckpointError(f"none of the {len(found)} checkpoints in {root} could be loaded: {'; '.join(skipped)}")
    return None


def read_unit_params(path) -> tuple[list[np.ndarray], dict]:
    """Every unit's unpadded flat parameters, from the files alone, and the metadata
    (its "model" rebuilds the model: trainer.sample)."""
    with _open_checkpoint(path) as ckpt:
        meta = _read_meta(ckpt)
        flats = []
        for unit in meta["units"]:
            name = f"unit{unit['index']}.param"
            entry = meta["arrays"][name]  # the schema made sure it is there, with the unit's numel
            flats.append(_read_range(ckpt, name, entry, 0, unit["numel"], resolve_dtype(entry["dtype"])))
    return flats, meta


def read_full_params(path) -> dict[str, np.ndarray]:
    """Every parameter by its full name ``"<unit>.<name>"`` (e.g. "0.0.weight"), from the files alone."""
    flats, meta = read_unit_params(path)
    out = {}
    for unit, flat in zip(meta["units"], flats):
        for spec in unit["params"]:  # inside the unit: trainer/ckptschema.py
            size = int(np.prod(spec["shape"], dtype=np.int64))
            out[f"{unit['index']}.{spec['name']}"] = flat[spec["offset"] : spec["offset"] + size].reshape(spec["shape"])
    return out


# ---- export --------------------------------------------------------------------------


def _write_npz_atomic(arrays: dict[str, np.ndarray], out: Path) -> Path:
    return ckptfs.write_atomic(out, lambda f: np.savez(f, **arrays))


def named_params(model, full: list[np.ndarray]) -> dict[str, np.ndarray]:
    """``{"<unit>.<param>": array}`` from per-unit flat arrays, names from ``unit.param_specs``."""
    return {f"{i}.{spec.name}": flat[spec.offset : spec.end].reshape(spec.shape)
            for i, (unit, flat) in enumerate(zip(model.units, full)) for spec in unit.param_specs}


async def export_npz(strategy, out) -> Path | None:
    """Writes the full parameters as one ``.npz`` of named arrays (rank 0 writes; every rank calls).

    Returns the path on rank 0, None elsewhere.
    """
    full = await strategy.full_params()
    if strategy.group.rank != 0:
        return None
    return _write_npz_atomic(named_params(strategy.model, full), Path(out))


def export_npz_from_checkpoint(path, out) -> Path:
    """The same ``.npz`` from a checkpoint's files, without any strategy or group.

    Raises:
        CheckpointError: what read_full_params raises (the checkpoint is not one we can trust).
    """
    return _write_npz_atomic(read_full_params(path), Path(out))
