"""Pipeline schedules as lists of actions: GPipe and 1F1B, their lowering to sends and receives,
and a simulation that gives their bubble.

What it is: each schedule is a pure function (pp, stage, m) -> the compute actions one stage
runs, in order: "F3" is micro-batch 3's forward through this stage, "B3" its backward. The
executor (trainer/parallel/executor.py) runs the list; tests compare lists; `format_table`
prints them side by side (torch.distributed.pipelining's view of a schedule).

    GPipe (all forwards, then all backwards), pp = 2, m = 4:
        stage 0: F0 F1 F2 F3 B0 B1 B2 B3
        stage 1: F0 F1 F2 F3 B0 B1 B2 B3
    1F1B (Megatron-LM core/pipeline_parallel/schedules.py, PipeDream-Flush), pp = 2, m = 4:
        stage 0: F0 F1 B0 F2 B1 F3 B2 B3         warm-up F0; steady (F1 B0) (F2 B1) (F3 B2); cool-down B3
        stage 1: F0 B0 F1 B1 F2 B2 F3 B3         no warm-up

1F1B on stage s: warm-up = min(pp - s - 1, m) forwards; steady state = m - warm-up pairs of
one forward then one backward; cool-down = the remaining warm-up backwards. So stage s holds
at most warm-up + 1 <= pp - s micro-batches of activations at once (at most pp, on the first
stage), where GPipe holds all m. Both keep backwards in micro-batch order, so a stage's last
action is B(m - 1): the place to reduce its gradients across data parallelism.

`lower(actions, pp, stage)` inserts the point-to-point actions:

    RECV_F j before F j (stage > 0)        SEND_F j after F j (stage < pp - 1)
    RECV_B j before B j (stage < pp - 1)   SEND_B j after B j (stage > 0)

(the executor posts each receive one compute action ahead, so the transfer overlaps compute).

`simulate(kind, pp, m, t_f, t_b)`: every stage runs its list, an action starting when its
stage is free and its input exists (F j on stage s after F j on s - 1, B j after B j on
s + 1); returns the makespan and each stage's idle time. With equal stages the bubble
fraction is (pp - 1) / (m + pp - 1) for both schedules (GPipe paper; Narayanan et al. 2021).

What it is not: no interleaved (virtual-stage) 1F1B, no zero-bubble schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "gpipe", "one_f_one_b", "SCHEDULES", "schedule", "lower", "in_flight_peak",
           "simulate", "bubble_formula", "format_table"]

COMPUTE = ("F", "B")
KINDS = ("F", "B", "RECV_F", "SEND_F", "RECV_B", "SEND_B")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" | "B" | "RECV_F" | "SEND_F" | "RECV_B" | "SEND_B"
    mb: int  # micro-batch, e.g. 3

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.mb < 0:
            raise ValueError(f"a pipeline Action needs a kind in {KINDS} and a micro-batch >= 0, "
                             f"got kind={self.kind!r} mb={self.mb}")

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"

    __repr__ = __str__


def _check(pp: int, stage: int, m: int) -> None:
    if pp < 1 or not 0 <= stage < pp or m < 1:
        raise ValueError(f"need pp >= 1, 0 <= stage < pp, m >= 1 micro-batches; got pp={pp} stage={stage} m={m}")


def gpipe(pp: int, stage: int, m: int) -> list[Action]:
    """All m forwards, then all m backwards (in micro-batch order)."""
    _check(pp, stage, m)
    return [Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)]


def one_f_one_b(pp: int, stage: int, m: int) -> list[Action]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards (module docstring)."""
    _check(pp, stage, m)
    warmup = min(pp - stage - 1, m)
    actions = [Action("F", j) for j in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", j) for j in range(m - warmup, m)]  # cool-down
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(kind: str, pp: int, stage: int, m: int) -> list[Action]:
    try:
        fn = SCHEDULES[kind]
    except KeyError:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {kind!r}") from None
    return fn(pp, stage, m)


def lower(actions: list[Action], pp: int, stage: int) -> list[Action]:
    """The compute actions with the sends and receives they need (module docstring)."""
    out = []
    for a in actions:
        if a.kind == "F":
            out += ([Action("RECV_F", a.mb)] if stage > 0 else []) + [a]
            out += [Action("SEND_F", a.mb)] if stage < pp - 1 else []
        elif a.kind == "B":
            out += ([Action("RECV_B", a.mb)] if stage < pp - 1 else []) + [a]
            out += [Action("SEND_B", a.mb)] if stage > 0 else []
        else:
            raise ValueError(f"lower takes compute actions only, got {a}")
    return out


def in_flight_peak(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and backward did not, at any point."""
    alive = peak = 0
    for a in actions:
        if a.kind == "F":
            alive += 1
            peak = max(peak, alive)
        elif a.kind == "B":
            alive -= 1
    return peak


def bubble_formula(pp: int, m: int) -> float:
    """(pp - 1) / (m + pp - 1): the idle fraction of an equal-stage pipeline."""
    return (pp - 1) / (m + pp - 1)


def simulate(kind: str, pp: int, m: int, t_f: float = 1.0, t_b: float = 2.0) -> tuple[float, list[float]]:
    """(makespan, idle time per stage) of the schedule with equal stages (module docstring).

    Raises:
        RuntimeError: the lists deadlock (an action waits on one that never runs).
    """
    lists = [schedule(kind, pp, s, m) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
    pos, free, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    while any(pos[s] < len(lists[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if pos[s] == len(lists[s]):
                continue
            a = lists[s][pos[s]]
            dep = (("F", s - 1, a.mb) if s > 0 else None) if a.kind == "F" else \
                  (("B", s + 1, a.mb) if s < pp - 1 else ("F", s, a.mb))
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep is not None else 0.0)
            cost = t_f if a.kind == "F" else t_b
            done[(a.kind, s, a.mb)] = free[s] = start + cost
            busy[s] += cost
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"schedule {kind} deadlocks at pp={pp} m={m}: positions {pos}")
    makespan = max(free)
    return makespan, [makespan - b for b in busy]


def format_table(kind: str, pp: int, m: int) -> str:
    """Every stage's compute actions, one line each, e.g. "stage 0: F0 F1 B0 F2 B1 B2"."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in schedule(kind, pp, s, m)) for s in range(pp))
