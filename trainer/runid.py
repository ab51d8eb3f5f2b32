"""A run's identity, and what a run does with a checkpoint directory: pure decisions, no files.

A *run* is one line of training that checkpoints continue: a fresh start, then every restart and
resume of it. Each checkpoint records it as ``metadata["run"] = {"id": 32 lowercase hex,
"config": {...}}``, the config being what must match to continue it (:func:`run_config`: the
model, the data, the optimizer's kind, a digest of the parameters' shapes, the batching); a
checkpoint written before runs were named is the *unnamed* run (:func:`legacy_config`). The id
comes from the job (:func:`job_identity`: SLURM_JOB_ID, TORCHELASTIC_RUN_ID or RINGWEAVE_JOB, the
same in every attempt), and an attempt is a restart when its restart count is above 0. README.md,
"Runs, resume and restarts", says what may change on resume and why.

What a run does with its checkpoint directory (:func:`decide`), in order::

    a restart, and its own run's checkpoints are there   continue them (whatever --resume says)
    no checkpoint there         --resume: refuse ("no checkpoint in DIR")    else start
    no --resume                 --move-aside: move every run there aside, start;  else refuse, naming it
    --resume, --resume auto     the one named run there (else the unnamed one): continue it if its config
                                matches, else refuse naming each field that differs; several named runs: refuse

    job = job_identity(os.environ)
    d = decide(found, where="ckpt", own_id=job.run_id(lambda: secrets.token_hex(16)), job=job,
               resume=Resume.of("auto"), move_aside=False, config=run_config(model, optimizer="adamw", batching=b))
    d.action                                 # Action.START / CONTINUE / MOVE_ASIDE / REFUSE (d.message says why)

Not here: reading the directory, moving checkpoints, agreeing across ranks (trainer/rundir.py).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

__all__ = ["RunError", "Resume", "JobIdentity", "job_identity", "run_config", "legacy_config", "run_of",
           "check_run", "check_config", "param_shapes", "Difference", "differences", "RunFound", "Action", "Decision",
           "decide", "choose_run", "to_load"]

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
JOB_KEYS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "RINGWEAVE_JOB")  # outermost first: it outlives the others
RESTART_COUNTERS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "RINGWEAVE_RESTART")
SPEC_FREE = ("dropout", "kernel")  # fields of a model spec that may change on resume (regularization, kernels)


class RunError(ValueError):
    """This run must not act on its checkpoint directory as asked; the message says why and what to do."""


class Resume(enum.Enum):
    NEVER = "never"    # no --resume: a new run
    ALWAYS = "always"  # --resume: continue, and a directory without a checkpoint is an error
    AUTO = "auto"      # --resume auto: continue if there is a checkpoint, else start

    @classmethod
    def of(cls, value) -> "Resume":
        """False/None -> NEVER, True -> ALWAYS, or a member's value ("never", "always", "auto")."""
        if value is None or value is False:
            return cls.NEVER
        if value is True:
            return cls.ALWAYS
        return value if isinstance(value, cls) else cls(value)


# ---- the job --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobIdentity:
    """The job this process belongs to, as its launchers name it."""
    key: str | None                # e.g. "SLURM_JOB_ID=5042"; None: no launcher names the job
    restart: int = 0               # attempts of the job before this one, over every counter
    counters: tuple[str, ...] = ()  # the counters above 0, e.g. ("SLURM_RESTART_COUNT=1",)

    def run_id(self, fresh: Callable[[], str]) -> str:
        """The id of a run this job starts: a digest of the key (the same in every attempt), else ``fresh()``."""
        if self.key is None:
            return fresh()
        return hashlib.sha256(b"ringweave-run\0" + self.key.encode()).hexdigest()[:32]


def job_identity(env: Mapping[str, str]) -> JobIdentity:
    """The job of ``env`` (os.environ): its key and restart count (the module docstring).

    Raises:
        RunError: a restart counter that is not a whole number >= 0.
    """
    key = next((f"{name}={env[name]}" for name in JOB_KEYS if env.get(name)), None)
    restart, counters = 0, []
    for name in RESTART_COUNTERS:
        text = env.get(name, "").strip()
        if not text:
            continue
        if not text.isdigit():
            raise RunError(f"{name}={text!r} is not a restart count (a whole number >= 0)")
        if int(text):
            restart += int(text)
            counters.append(f"{name}={int(text)}")
    return JobIdentity(key, restart, tuple(counters))


# ---- the config -------------------------------------------------------------------------------


def param_shapes(units) -> list[list]:
    """[["<unit>.<name>", [shape]], ...] of a model's units (ParamSpec) or a checkpoint's "units"."""
    out = []
    for i, unit in enumerate(units):
        if isinstance(unit, dict):
            out += [[f"{unit['index']}.{p['name']}", list(p["shape"])] for p in unit["params"]]
        else:
            out += [[f"{i}.{s.name}", list(s.shape)] for s in unit.param_specs]
    return out


def _digest(shapes: list[list]) -> str:
    return hashlib.sha256(json.dumps(shapes, separators=(",", ":")).encode()).hexdigest()[:16]


def _spec_fields(spec) -> dict:
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        return {}
    config = spec.get("config") if isinstance(spec.get("config"), dict) else {}
    return {"model": spec["kind"], **{k: v for k, v in config.items() if k not in SPEC_FREE}}


def run_config(model, *, optimizer: str, batching: Mapping, fields: Mapping | None = None) -> dict:
    """What must match to continue a run of ``model`` (the logical, whole model), e.g.
    {"model": "gpt", "n_layer": 4, ..., "params": "5b0e...", "param_count": 827392,
    "optimizer": "adamw", "n_train": 6000, "global_batch_size": 64, "grad_accum": 1, "seed": 0};
    ``fields`` (the caller's: the data set, an MLP's widths) are added and win."""
    spec = model.spec() if hasattr(model, "spec") else None
    units = getattr(model, "units", None) or []
    config = {**_spec_fields(spec), "params": _digest(param_shapes(units)),
              "param_count": int(sum(u.numel for u in units)), "optimizer": optimizer,
              **dict(batching), **dict(fields or {})}
    check_config(config)
    return config


def legacy_config(meta: Mapping) -> dict:
    """What an unnamed run's checkpoint metadata tells of its config (missing fields are not compared)."""
    config = dict(_spec_fields(meta.get("model")))
    units = meta.get("units")
    if isinstance(units, list):
        try:
            config.update(params=_digest(param_shapes(units)), param_count=int(sum(u["numel"] for u in units)))
        except (KeyError, TypeError, ValueError):
            pass
    if isinstance(meta.get("optimizer"), str):
        config["optimizer"] = meta["optimizer"]
    loop = (meta.get("extra") or {}).get("loop") if isinstance(meta.get("extra"), dict) else None
    batching = loop.get("run") if isinstance(loop, dict) else None
    if isinstance(batching, dict):
        config.update({k: v for k, v in batching.items() if _scalar(v)})
    return config


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def check_config(config) -> None:
    """Raises ValueError unless ``config`` is {str: JSON scalar or list of scalars}."""
    if not isinstance(config, dict):
        raise ValueError(f"a run's config must be a dict, got {type(config).__name__}")
    for name, value in config.items():
        if not isinstance(name, str) or not (_scalar(value) or (isinstance(value, list)
                                                                and all(_scalar(v) for v in value))):
            raise ValueError(f"run config field {name!r} = {value!r}: must be a JSON scalar or a list of scalars")


def check_run(run) -> None:
    """Raises ValueError unless ``run`` is {"id": 32 lowercase hex, "config": {...}} and nothing else."""
    if not isinstance(run, dict) or set(run) != {"id", "config"}:
        raise ValueError(f"a run must be {{'id': ..., 'config': ...}}, got {run!r:.200}")
    if not isinstance(run["id"], str) or not RUN_ID.match(run["id"]):
        raise ValueError(f"a run id is 32 lowercase hex characters, got {run['id']!r:.60}")
    check_config(run["config"])


def run_of(meta: Mapping) -> str | None:
    """The run id a checkpoint's metadata names; None: an unnamed run's (no "run").

    Raises:
        ValueError: a "run" that breaks the contract (check_run).
    """
    if "run" not in meta:
        return None
    check_run(meta["run"])
    return meta["run"]["id"]


@dataclass(frozen=True)
class Difference:
    field: str
    old: object  # the checkpoint's (None: not there)
    new: object  # this run's

    def __str__(self) -> str:
        return f"{self.field}: {json.dumps(self.old)} -> {json.dumps(self.new)}"


def _param_change(old: list[list], new: list[list]) -> str:
    """The first parameter that differs, e.g. "params: 2.ln.weight [128] -> [64]"."""
    olds, news = {n: s for n, s in old}, {n: s for n, s in new}
    for name, shape in old:
        if name not in news:
            return f"params: {name} {shape} -> not in this model"
        if news[name] != shape:
            return f"params: {name} {shape} -> {news[name]}"
    for name, shape in new:
        if name not in olds:
            return f"params: not in the checkpoint -> {name} {shape}"
    return "params: the parameters' order differs"


def differences(old: Mapping, new: Mapping, old_shapes: list[list] | None = None,
                new_shapes: list[list] | None = None) -> list[str]:
    """Each field that both configs hold and that differs, e.g. ["n_layer: 2 -> 1"]; "params"
    names the first differing parameter when both parameter lists are given."""
    out = []
    for name in new:
        if name in old and old[name] != new[name]:
            if name == "params" and old_shapes is not None and new_shapes is not None:
                out.append(_param_change(old_shapes, new_shapes))
            else:
                out.append(str(Difference(name, old[name], new[name])))
    return out


# ---- the directory's runs and the decision ------------------------------------------------------


@dataclass(frozen=True)
class RunFound:
    """The committed checkpoints of one run in a directory (id None: the unnamed run, whose
    checkpoints predate run ids; ``readable`` False: checkpoints whose metadata cannot be read,
    or whose "run" breaks the contract; ``tried`` False for the latter: loading would not notice)."""
    id: str | None
    names: tuple[str, ...]            # its step directories, oldest first, e.g. ("step-00000040",)
    steps: tuple[int, ...]            # their steps
    created_unix_s: float | None = None  # when its newest checkpoint was saved
    config: dict = field(default_factory=dict)
    shapes: list | None = None        # its parameters [[name, shape], ...], for naming a difference
    readable: bool = True
    tried: bool = True                # unreadable ones: offered to the loader, which fails on them and says why

    def describe(self) -> str:
        """E.g. "run 3fa85f64... (newest step 40, saved 2025-01-02 10:11:12, 2 checkpoints)"."""
        if not self.readable:
            who = "checkpoints whose metadata cannot be read" if self.tried else "checkpoints with a damaged \"run\""
        else:
            who = f"run {self.id}" if self.id else "an unnamed run (saved before checkpoints named their run)"
        when = (f", saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.created_unix_s))}"
                if self.created_unix_s else "")
        return f"{who} (newest step {max(self.steps)}{when}, {len(self.names)} checkpoint(s))"


def choose_run(found: Sequence[RunFound], where: str) -> RunFound | None:
    """The run to read or continue in a directory: its one named run, else its unnamed one, else
    None (nothing readable). Never a mix.

    Raises:
        RunError: several named runs, naming each.
    """
    named = [r for r in found if r.readable and r.id is not None]
    if len(named) > 1:
        runs = "; ".join(r.describe() for r in named)
        raise RunError(f"{where} holds the checkpoints of {len(named)} runs ({runs}): move the step-* directories "
                       f"of all but one elsewhere, or give one checkpoint directory")
    return named[0] if named else next((r for r in found if r.readable and r.id is None), None)


class Action(enum.Enum):
    START = "start"            # a new run: no checkpoint to load
    CONTINUE = "continue"      # load the newest valid checkpoint of ``Decision.source``
    MOVE_ASIDE = "move-aside"  # move ``Decision.aside`` out of the directory, then start
    REFUSE = "refuse"          # raise RunError(Decision.message) on every rank


@dataclass(frozen=True)
class Decision:
    action: Action
    run_id: str = ""                   # the id this run's checkpoints carry from now on
    source: RunFound | None = None     # CONTINUE: the run continued
    aside: tuple[RunFound, ...] = ()   # MOVE_ASIDE: the runs moved aside
    message: str = ""                  # REFUSE: the error; else a note for the log ("" for none)


def decide(found: Sequence[RunFound], *, where: str, own_id: str, job: JobIdentity, resume: Resume,
           move_aside: bool, config: Mapping, shapes: list | None = None) -> Decision:
    """What a run does with the directory ``where`` that holds ``found`` (the module docstring's table).

    Args:
        found: its runs (rundir.runs_in), readable or not.
        own_id: the id this job gives a run it starts (JobIdentity.run_id).
        config / shapes: this run's config (run_config) and parameters, compared with a continued run's.
    """
    restart = f"restart {job.restart} of the run {own_id}" if job.restart else ""
    own = next((r for r in found if r.readable and r.id == own_id), None)
    if job.restart and own is not None:
        return _continue(own, own_id, config, shapes, where, f"{restart}: {', '.join(job.counters)}")
    if not found:
        if resume is Resume.ALWAYS:
            return Decision(Action.REFUSE, message=f"no checkpoint in {where}; to start fresh drop --resume, or use "
                                                   f"--resume auto to resume only when there is one")
        note = f"{restart}: no checkpoint of it in {where} yet, starting from step 0" if restart else ""
        return Decision(Action.START, own_id, message=note)
    if resume is Resume.NEVER:
        if move_aside:
            return Decision(Action.MOVE_ASIDE, own_id, aside=tuple(found))
        runs = "; ".join(r.describe() for r in found)
        return Decision(Action.REFUSE, message=(
            f"{(restart + ': ') if restart else ''}{where} holds the checkpoints of another run, {runs}; to continue "
            f"it add --resume, to start a new run choose another --checkpoint-dir or add --move-aside (its "
            f"checkpoints move into {where}/aside-*/, nothing is deleted)"))
    try:
        source = choose_run(found, where)
    except RunError as exc:
        return Decision(Action.REFUSE, message=str(exc))
    if source is None:  # only checkpoints that cannot be read: loading them says why each fails
        if not any(r.tried for r in found):
            return Decision(Action.REFUSE, message=f"{where} holds no checkpoint that can be continued: "
                                                   f"{'; '.join(r.describe() for r in found)}")
        return Decision(Action.CONTINUE, own_id, source=None, message="")
    return _continue(source, source.id or own_id, config, shapes, where, f"run {source.id or own_id}")


def to_load(source: RunFound | None, found: Sequence[RunFound]) -> list[str]:
    """The checkpoints to try for ``source`` (None: none readable), oldest first: its own, and those
    whose metadata cannot be read (they fail to load, and the log says why; they never load
    instead of ``source``'s)."""
    names = [n for r in found if not r.readable and r.tried for n in r.names] + list(source.names if source else ())
    return sorted(set(names), key=lambda n: int(n.split("-", 1)[1]))


def _continue(source: RunFound, run_id: str, config: Mapping, shapes, where: str, note: str) -> Decision:
    diff = differences(source.config, config, source.shapes, shapes)
    if diff:
        who = f"run {source.id}" if source.id else "the unnamed run"
        return Decision(Action.REFUSE, message=(
            f"cannot continue {who} in {where}: {len(diff)} setting(s) differ from its checkpoints (checkpoint -> "
            f"now): {'; '.join(diff)}; use its settings, or start a new run in another --checkpoint-dir"))
    return Decision(Action.CONTINUE, run_id, source=source, message=note)
