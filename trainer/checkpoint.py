"""Sharded, atomic checkpoints; loading onto any world size and strategy; full-parameter export.

What it is. A checkpoint is a directory; every rank writes its own shards, and
rank 0 writes one metadata file that describes the global layout::

    root/
      step-00000040/                      # a committed checkpoint (what latest() finds)
        metadata.json                     # the global layout, below
        rank00000/unit0.param.npy         # rank 0's piece of unit 0's flat parameters
        rank00000/unit0.exp_avg.npy       # ... and of its optimizer state
        rank00001/...
      step-00000050/
      .tmp-step-00000060/                 # a save in progress (or a crashed one): never read

    metadata.json = {
      "format": "ringweave-checkpoint", "version": 1,
      "step": 40, "optim_step": 40, "strategy": "zero3", "world_size": 4,
      "optimizer": "adamw", "master_dtype": "float32",
      "scaler": {"scale": 65536.0, "good_steps": 40},
      "extra": {"epoch": 1, "batch": 12},            # the loop's position in the data
      "model": {"kind": "gpt", "config": {...}},     # model.spec() when the model has one (trainer.sample)
      "run": {"id": "3fa85f64...", "config": {...}}, # the run it belongs to (trainer/runid.py); absent: unnamed
      "units": [{"index": 0, "numel": 17152,
                 "params": [{"name": "0.weight", "shape": [64, 256], "offset": 0}, ...]}, ...],
      "arrays": {"unit0.param": {"numel": 17152, "dtype": "float32",
                                 "pieces": [{"file": "rank00000/unit0.param.npy",
                                             "start": 0, "stop": 4288, "crc32": 1234}, ...]}, ...}}

Every array is one unit's UNPADDED flat buffer (padding depends on the world
size, so it is never stored); its pieces tile [0, numel). A replicated array
(ddp) is written once, by rank 0. Loading asks the strategy which ranges this
rank needs (``strategy.state_dict()["layout"]``) and cuts them from the pieces
(memory-mapped, so a rank reads only what overlaps its shard): that is the
resharding onto another world size or strategy. A mesh strategy (trainer/parallel)
saves the full model's units in this same layout (``sharded_state_dict``, and
``logical_model`` for the metadata; "mesh" records its shape) and asks, per array,
for the positions its tensor-parallel cut holds (``layout[name]["index"]``), so a
checkpoint saved at tp=2 pp=2 loads at dp=4 or on one rank, and the reverse.

Atomic save, in order:
    1. rank 0 clears stale ``.tmp-*`` directories and makes ``.tmp-step-S``; barrier;
    2. every rank writes and fsyncs its pieces and an index of them; a failure is
       caught and reported, not left to hang the others;
    3. all_reduce of the failure flags: if any rank failed, rank 0 deletes the
       temporary directory and EVERY rank raises CheckpointError naming the ranks;
    4. rank 0 merges the indexes into metadata.json (fsync), renames the directory to
       ``step-S`` (fsync of the root), and deletes all but the newest ``keep_last`` of the
       checkpoints of the same run (the same "run" id, or none for a save without one):
       another run's checkpoints, and one whose metadata cannot be read, are never deleted;
    5. a last all_reduce: nobody returns before the commit (or its failure) is known.
A process killed anywhere before the rename leaves only a ``.tmp-*`` directory,
which ``latest()`` ignores, so the previous checkpoint stays the one loaded.
Ranks must share the file system (one directory seen by all).

Resume: the metadata keeps ``step`` (train_step calls, which key dropout and the
schedule), the optimizer state and its step, the loss scaler, and the loop's
``extra`` (store the epoch and the batch index within it, so the loop can skip
the batches already consumed; data order is a pure function of (seed, epoch)).
:func:`load_newest_valid` is what a resume calls: the newest checkpoint that every
rank can read and verify (CRCs), falling back to older ones when a newer one is
damaged (a disk error, a partial copy), so a restart does not fail, or loop under
``--max-restarts``, while an intact checkpoint is there; every rank ends on the same one.

What it is not: no asynchronous (background) saving, no object-store backends.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np

from trainer import runid
from trainer.precision import resolve_dtype

log = logging.getLogger("ringweave.checkpoint")

__all__ = ["CheckpointError", "save", "load", "load_newest_valid", "latest", "list_checkpoints", "read_metadata",
           "read_full_params", "read_unit_params", "export_npz", "export_npz_from_checkpoint"]

FORMAT, VERSION = "ringweave-checkpoint", 1
METADATA = "metadata.json"


class CheckpointError(RuntimeError):
    """A save that failed (naming the ranks) or a checkpoint that cannot be loaded (naming the file)."""


def _after_piece_written(rank: int, name: str) -> None:
    """Fault-injection point for tests: called after each piece is durable. Does nothing."""


# ---- file helpers -------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8)) & 0xFFFFFFFF


def _step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


async def _all_reduce_sum(strategy, values: np.ndarray) -> np.ndarray:
    """Sum over the strategy's group (a barrier too); free at world size 1."""
    if strategy.group.size > 1:
        import collectives

        await collectives.all_reduce(values, op="sum", group=strategy.group)
    return values


# ---- save -------------------------------------------------------------------------


def _write_pieces(state: dict, tmp: Path, rank: int) -> dict:
    """Writes this rank's pieces into tmp/rankRRRRR/; returns {name: piece} for the index."""
    rank_dir = tmp / f"rank{rank:05d}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    pieces = {}
    for name, shard in state["shards"].items():
        lay = state["layout"][name]
        if lay["replicated"] and rank != 0:
            continue  # written once, by rank 0
        shard = np.ascontiguousarray(shard)
        if shard.size == 0:
            continue  # a shard wholly inside the padding
        rel = f"{rank_dir.name}/{name}.npy"
        _write_durable(tmp / rel, lambda f, a=shard: np.save(f, a, allow_pickle=False))
        pieces[name] = {"file": rel, "start": int(lay["start"]), "stop": int(lay["start"]) + int(shard.size),
                        "crc32": _crc(shard), "numel": int(lay["numel"]), "dtype": shard.dtype.name}
        _after_piece_written(rank, name)
    _write_durable(rank_dir / "index.json", lambda f: f.write(json.dumps({"rank": rank, "pieces": pieces}).encode()))
    _fsync_dir(rank_dir)
    return pieces


def _metadata(state: dict, model, tmp: Path, world: int, extra: dict | None, run: dict | None) -> dict:
    model_units = model.units
    arrays: dict[str, dict] = {}
    for r in range(world):
        index = json.loads((tmp / f"rank{r:05d}" / "index.json").read_text())
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


async def save(strategy, root, *, extra: dict | None = None, keep_last: int = 3, run: dict | None = None) -> Path:
    """Saves ``strategy``'s state under ``root/step-SSSSSSSS``; every rank of its group calls it.

    Args:
        strategy: a set-up Strategy (has ``group``, ``model``, ``state_dict()``).
        root: the checkpoint directory (made if missing), the same path on every rank.
        extra: JSON-able loop state, e.g. ``{"epoch": 2, "batch": 7}``.
        keep_last: committed checkpoints of this run kept (its older ones are deleted), >= 1.
        run: ``{"id": 32 lowercase hex, "config": {name: JSON scalar or list of scalars}}``, the run
            this checkpoint belongs to (trainer/runid.py), stored as metadata["run"]; None: none.
    Returns:
        The committed checkpoint's directory.
    Raises:
        CheckpointError: on every rank, naming the ranks whose write failed; the
            previous checkpoints are untouched.
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
    name = _step_dir_name(int(state["step"]))
    tmp, final = root / f".tmp-{name}", root / name
    # 1. rank 0 prepares an empty temporary directory
    failed = np.zeros(world, dtype=np.float64)
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            failed[0] = 1
            prepare_error = exc
    await _all_reduce_sum(strategy, failed)
    if failed[0]:
        raise CheckpointError(f"save to {root}: rank 0 could not prepare {tmp}"
                              + (f": {prepare_error}" if rank == 0 else ""))
    # 2. every rank writes its pieces
    error = None
    try:
        _write_pieces(state, tmp, rank)
    except Exception as exc:  # reported to every rank below, never left to hang them
        error = exc
        failed[rank] = 1
    # 3. agree on failures
    await _all_reduce_sum(strategy, failed)
    bad = [r for r in range(world) if failed[r]]
    if bad:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"save of {name} to {root} failed on rank(s) {bad}; the previous checkpoint is intact"
                              + (f" (this rank: {error!r})" if error else "")) from error
    # 4. rank 0 commits
    commit = np.zeros(1, dtype=np.float64)
    if rank == 0:
        try:
            meta = _metadata(state, getattr(strategy, "logical_model", strategy.model), tmp, world, extra, run)
            _write_durable(tmp / METADATA, lambda f: f.write(json.dumps(meta, indent=1).encode()))
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again: replace it
                old = root / f".tmp-old-{name}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(root)
            for stale in _own_checkpoints(root, run["id"] if run else None)[:-keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
        except Exception as exc:
            commit[0] = 1
            error = exc
    # 5. nobody returns before the commit is known
    await _all_reduce_sum(strategy, commit)
    if commit[0]:
        raise CheckpointError(f"commit of {name} in {root} failed on rank 0"
                              + (f": {error!r}" if error else "")) from error
    return final


# ---- finding and reading ---------------------------------------------------------


def list_checkpoints(root) -> list[Path]:
    """Committed checkpoints under ``root``, oldest first (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / METADATA).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def latest(root) -> Path | None:
    """The newest committed checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _resolve(path) -> Path:
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"no committed checkpoint in {path} (looked for {METADATA} or step-*/{METADATA})")
    return found


def read_metadata(path) -> dict:
    """The metadata of a checkpoint directory (or of the newest one under a root)."""
    path = _resolve(path)
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / METADATA}: {exc}") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path / METADATA}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                              f"expected {FORMAT!r} version {VERSION}")
    meta["path"] = str(path)
    return meta


def _read_range(path: Path, name: str, entry: dict, lo: int, hi: int, dtype) -> np.ndarray:
    """Elements [lo, hi) of array ``name``, assembled from the pieces that overlap them."""
    out = np.zeros(hi - lo, dtype=dtype)
    covered = 0
    for piece in entry["pieces"]:
        a, b = max(lo, piece["start"]), min(hi, piece["stop"])
        if a >= b:
            continue
        file = path / piece["file"]
        try:
            data = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {file} ({name}): {exc}") from exc
        if data.shape != (piece["stop"] - piece["start"],) or _crc(data) != piece["crc32"]:
            raise CheckpointError(f"{file} ({name}) is corrupt: shape {data.shape} / checksum differ from "
                                  f"{METADATA}")
        out[a - lo : b - lo] = data[a - piece["start"] : b - piece["start"]]
        covered += b - a
    if covered != hi - lo:
        raise CheckpointError(f"{path}: pieces of {name!r} cover {covered} of the {hi - lo} elements "
                              f"[{lo}, {hi}) this rank needs")
    return out


def load(strategy, path) -> dict:
    """Loads a checkpoint into a set-up ``strategy`` of any world size and strategy; returns the metadata.

    ``path`` is a checkpoint directory or a root (its newest checkpoint is used).
    Local: no collective runs here (parameters that must be re-gathered are, at
    the strategy's next async call). ``metadata["extra"]`` is what ``save`` got.

    Raises:
        CheckpointError: nothing committed there, a missing or corrupt piece, or a
            layout that does not match the model (names the array).
    """
    meta = read_metadata(path)
    ckpt = Path(meta["path"])
    want = strategy.state_dict()
    shards = {}
    for name, lay in want["layout"].items():
        entry = meta["arrays"].get(name)
        if entry is None:
            raise CheckpointError(f"{ckpt}: no array {name!r} (saved with optimizer {meta['optimizer']!r} and "
                                  f"{len(meta['units'])} units; this run uses {want['optimizer']!r} and "
                                  f"{len(strategy.model.units)} units)")
        if entry["numel"] != lay["numel"]:
            raise CheckpointError(f"{ckpt}: {name!r} has {entry['numel']} elements, the model's has {lay['numel']}")
        n, dtype = len(want["shards"][name]), np.asarray(want["shards"][name]).dtype
        if "index" in lay:  # scattered elements (a tensor-parallel cut): the range around them, then a take
            index = np.asarray(lay["index"], dtype=np.int64)
            lo, hi = (int(index.min()), int(index.max()) + 1) if index.size else (0, 0)
            shards[name] = _read_range(ckpt, name, entry, lo, hi, dtype)[index - lo]
        else:
            shards[name] = _read_range(ckpt, name, entry, lay["start"], lay["start"] + n, dtype)
    strategy.load_state_dict({**want, "shards": shards, "step": meta["step"], "optim_step": meta["optim_step"],
                              "scaler": meta["scaler"]})
    return meta


async def load_newest_valid(strategy, root, candidates=None) -> dict | None:
    """Loads the newest checkpoint under ``root`` that loads and verifies on every rank; returns
    its metadata, or None when ``root`` holds no committed checkpoint. ``candidates``: the
    checkpoint directories to try instead of all of root's, oldest first (the same list on every
    rank: one run's, trainer/rundir.py). A collective over the
    strategy's group: every rank tries the same checkpoints in the same order (newest first) and
    they agree, after each, whether all succeeded (an all_reduce of the failures), so all end on
    the same one. Each one skipped is logged with why.

    Raises:
        CheckpointError: there are checkpoints, and none loads (names each and why).
    """
    found = list_checkpoints(root) if candidates is None else [Path(p) for p in candidates]
    skipped = []
    for path in reversed(found):
        try:
            meta, error = load(strategy, path), None
        except CheckpointError as exc:
            meta, error = None, exc
        failed = await _all_reduce_sum(strategy, np.array([0.0 if error is None else 1.0]))
        if failed[0] == 0:
            if skipped:
                log.warning("resuming from %s: the newer %s could not be loaded", path, ", ".join(skipped))
            return meta
        why = error if error is not None else f"{int(failed[0])} other rank(s) could not load it"
        log.warning("checkpoint %s cannot be loaded (%s); trying the one before", path, why)
        skipped.append(f"{path.name} ({why})")
    if found:
        raise CheckpointError(f"none of the {len(found)} checkpoints in {root} could be loaded: {'; '.join(skipped)}")
    return None


def read_unit_params(path) -> tuple[list[np.ndarray], dict]:
    """Every unit's unpadded flat parameters, from the files alone, and the metadata
    (its "model" rebuilds the model: trainer.sample)."""
    meta = read_metadata(path)
    ckpt = Path(meta["path"])
    flats = []
    for unit in meta["units"]:
        name = f"unit{unit['index']}.param"
        entry = meta["arrays"][name]
        flats.append(_read_range(ckpt, name, entry, 0, unit["numel"], resolve_dtype(entry["dtype"])))
    return flats, meta


def read_full_params(path) -> dict[str, np.ndarray]:
    """Every parameter by its full name ``"<unit>.<name>"`` (e.g. "0.0.weight"), from the files alone."""
    meta = read_metadata(path)
    ckpt = Path(meta["path"])
    out = {}
    for unit in meta["units"]:
        name = f"unit{unit['index']}.param"
        entry = meta["arrays"][name]
        flat = _read_range(ckpt, name, entry, 0, unit["numel"], resolve_dtype(entry["dtype"]))
        for spec in unit["params"]:
            size = int(np.prod(spec["shape"], dtype=np.int64))
            out[f"{unit['index']}.{spec['name']}"] = flat[spec["offset"] : spec["offset"] + size].reshape(spec["shape"])
    return out


# ---- export --------------------------------------------------------------------------


def _write_npz_atomic(arrays: dict[str, np.ndarray], out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    _write_durable(tmp, lambda f: np.savez(f, **arrays))
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    return out


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
    """The same ``.npz`` from a checkpoint's files, without any strategy or group."""
    return _write_npz_atomic(read_full_params(path), Path(out))
