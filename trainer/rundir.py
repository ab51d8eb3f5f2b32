"""A checkpoint directory's runs, read and acted on: the files-and-ranks half of trainer/runid.py.

    opened = await open_run("ckpt", group, environ=os.environ, config=config, shapes=shapes,
                            resume=Resume.NEVER, move_aside=False)
    opened.run_id        # the id this run's checkpoints carry, e.g. "3fa85f6457174562b3fc2c963f66afa6"
    opened.candidates    # the checkpoints to load, oldest first (empty: start from step 0)
    opened.note          # one line for rank 0's log ("" for none)

Rank 0 alone reads the directory (the metadata of every committed checkpoint, through
trainer.checkpoint.read_metadata), decides (runid.decide), moves checkpoints aside where told,
and broadcasts the outcome (msgpack, collectives.objects): every rank acts on one decision,
and on a refusal every rank raises the same RunError. A failure of rank 0 while it reads or
moves becomes that refusal, so no rank waits for an answer that will not come.

Moving aside renames a run's step directories, relative to a descriptor of the directory
opened without following a link, into a new sub-directory ``DIR/aside-<run id>-<local time>/``
(mode 0700; "unnamed" for checkpoints that name no run, "unreadable" for those whose
metadata cannot be read). Nothing is copied or deleted, and list_checkpoints no longer sees them.

:func:`checkpoints_to_read` serves trainer.sample: the one run's checkpoints, never a mix.

Not here: the decisions (trainer/runid.py), loading and saving (trainer/checkpoint.py).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from trainer import checkpoint, ckptfs, runid
from trainer.runid import Action, Resume, RunError, RunFound

__all__ = ["Opened", "open_run", "runs_in", "move_aside", "checkpoints_to_read"]

_UNREADABLE, _BAD_RUN = "?", "!"  # runs_in's keys (never run ids): metadata that cannot be read; a broken "run"


def runs_in(root) -> list[RunFound]:
    """The runs whose committed checkpoints are under ``root`` (none if it does not exist)."""
    groups: dict[str | None, list] = {}
    for path in checkpoint.list_checkpoints(root):
        try:
            meta = checkpoint.read_metadata(path)
        except checkpoint.CheckpointError:
            groups.setdefault(_UNREADABLE, []).append((path, None))
            continue
        try:
            key = runid.run_of(meta)
        except ValueError:  # loading does not read "run": such a checkpoint must not be offered to it
            meta, key = None, _BAD_RUN
        groups.setdefault(key, []).append((path, meta))
    return [_found(key, items) for key, items in groups.items()]


def _found(key: str | None, items: list) -> RunFound:
    names = tuple(p.name for p, _ in items)
    steps = tuple(int(n.split("-", 1)[1]) for n in names)
    if key in (_UNREADABLE, _BAD_RUN):
        return RunFound(None, names, steps, readable=False, tried=key == _UNREADABLE)
    newest = items[-1][1]
    created = newest.get("created_unix_s")
    try:
        shapes = runid.param_shapes(newest.get("units") or [])
    except (KeyError, TypeError):
        shapes = None
    return RunFound(key, names, steps, float(created) if isinstance(created, (int, float)) else None,
                    newest["run"]["config"] if key else runid.legacy_config(newest), shapes)


def move_aside(root, runs, now: float | None = None) -> list[str]:
    """Renames each run's step directories into a new ``root/aside-<label>-<time>/`` (0700), all
    through checked descriptors (trainer/ckptfs.py); returns those names."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(time.time() if now is None else now))
    made = []
    rootdir = ckptfs.open_root(root)
    if rootdir is None:  # nothing is there to move
        return made
    with rootdir:
        for run in runs:
            label = run.id or ("unnamed" if run.readable else "unreadable")
            name, aside = _new_dir(rootdir, f"aside-{label}-{stamp}")
            with aside:
                for step in run.names:
                    os.rename(step, step, src_dir_fd=rootdir.fd, dst_dir_fd=aside.fd)
                aside.fsync()
            made.append(name)
        rootdir.fsync()
    return made


def _new_dir(rootdir, base: str):
    """(name, Dir) of a new directory under ``rootdir``: ``base``, else ``base-2``, ``base-3``, ..."""
    for n in range(1, 1000):
        name = base if n == 1 else f"{base}-{n}"
        try:
            return name, rootdir.make(name)
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: 999 directories of that name exist already")


@dataclass(frozen=True)
class Opened:
    run_id: str                   # 32 lowercase hex
    candidates: tuple[str, ...]   # step directories to try, oldest first; empty: start from step 0
    note: str = ""                # for rank 0's log


def _decide_and_act(directory: str, environ: Mapping[str, str], config: dict, shapes, resume: Resume,
                    move: bool) -> dict:
    """Rank 0's part of open_run: read, decide, move aside; the answer it broadcasts."""
    found = runs_in(directory)
    job = runid.job_identity(environ)
    own = job.run_id(lambda: secrets.token_hex(16))
    d = runid.decide(found, where=directory, own_id=own, job=job, resume=resume, move_aside=move, config=config,
                     shapes=shapes)
    if d.action is Action.REFUSE:
        return {"refuse": d.message}
    note = d.message
    if d.action is Action.MOVE_ASIDE:
        made = move_aside(directory, d.aside)
        note = "; ".join(f"moved {run.describe()} into {os.path.join(directory, name)}"
                         for run, name in zip(d.aside, made)) + f"; run {d.run_id} starts"
    candidates = runid.to_load(d.source, found) if d.action is Action.CONTINUE else []
    return {"refuse": "", "run_id": d.run_id, "candidates": candidates, "note": note}


async def open_run(directory, group, *, environ: Mapping[str, str], config: dict, shapes=None,
                   resume: Resume = Resume.NEVER, move_aside: bool = False) -> Opened:
    """What this run is in ``directory`` (the module docstring); every rank of ``group`` calls it
    (None: a single process).

    Raises:
        RunError: on every rank, when the run must not go on (runid.decide's refusals, or rank 0
            could not read or move what it had to).
    """
    directory = str(directory)
    answer = None
    if group is None or group.rank == 0:
        try:
            answer = _decide_and_act(directory, environ, config, shapes, resume, move_aside)
        except RunError as exc:  # a restart counter that is not a count
            answer = {"refuse": str(exc)}
        except Exception as exc:  # told to every rank below, never left to hang them
            answer = {"refuse": f"cannot use the checkpoint directory {directory}: {type(exc).__name__}: {exc}"}
    if group is not None and group.size > 1:
        from collectives.objects import broadcast_object  # local: the loop runs single-process without it

        answer = await broadcast_object(answer, src=0, group=group)
    if answer["refuse"]:
        raise RunError(answer["refuse"])
    return Opened(answer["run_id"], tuple(answer["candidates"]), answer["note"])


def checkpoints_to_read(root) -> tuple[RunFound | None, list[Path]]:
    """The run trainer.sample reads under ``root`` and the checkpoints to try for it, oldest
    first (runid.choose_run, runid.to_load); (None, []) when there is no checkpoint.

    Raises:
        RunError: several named runs are there.
    """
    found = runs_in(root)
    run = runid.choose_run(found, str(root))
    return run, [Path(root) / name for name in runid.to_load(run, found)]
