"""Pipeline schedules as lists of actions: GPipe and 1F1B, their lowering to the sends and
receives between stages, and a simulation that runs the lowered lists.

Each schedule is a pure function (pp, stage, m) -> the compute actions one stage runs, in order:
"F3" is micro-batch 3's forward through this stage, "B3" its backward.

    GPipe, pp = 2, m = 4, both stages:  F0 F1 F2 F3 B0 B1 B2 B3
    1F1B (Megatron-LM, PipeDream-Flush), pp = 2, m = 4:
        stage 0: F0 F1 B0 F2 B1 F3 B2 B3         warm-up F0; steady (F1 B0) (F2 B1) (F3 B2); cool-down B3
        stage 1: F0 B0 F1 B1 F2 B2 F3 B3         no warm-up

1F1B on stage s runs min(pp - s - 1, m) warm-up forwards, then (F, B) pairs, then the remaining
backwards, so it holds at most pp - s micro-batches of activations where GPipe holds all m. Both
keep backwards in micro-batch order: a stage's last action, B(m - 1), reduces its gradients.

`lower(actions, pp, stage)` is the one description of where a stage's sends and receives happen;
the executor (executor.py) and `simulate` both run its lists. RECV_x j posts a receive that F j or
B j then waits on; SEND_x j launches a send that nothing waits on:

    1F1B, pp = 3, stage 1, m = 2:
        RECV_F0 RECV_F1 F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 SEND_B0 B1 SEND_B1

`simulate(kind, pp, m, t_f, t_b)` gives the makespan and each stage's idle time, and raises on a
deadlock; with equal stages the idle fraction is (pp - 1) / (m + pp - 1). The rules and their
reasons: docs/design.md, "The lowered schedule". Not here: interleaved (virtual-stage) 1F1B,
zero-bubble schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "gpipe", "one_f_one_b", "SCHEDULES", "schedule", "lower", "in_flight_peak",
           "simulate", "simulate_lists", "bubble_formula", "format_table"]

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
    """The compute actions with the point-to-point actions between them (module docstring):

        RECV_F j   (stage > 0) while j < backwards done + in_flight_peak(actions) + 2: posted
                   ahead, so the activation lands in its buffer (docs/design.md says why + 2)
        SEND_F j   (stage < pp - 1) right after F j
        RECV_B j   (stage < pp - 1, B j in the list) right after SEND_F j: the next stage can
                   send the gradient only after that
        SEND_B j   (stage > 0) right after B j, and after the RECV_Fs it allows

    Raises:
        ValueError: a non-compute action, or forwards not in micro-batch order 0, 1, 2, ...
    """
    if any(a.kind not in COMPUTE for a in actions):
        raise ValueError(f"lower takes compute actions only, got {[str(a) for a in actions if a.kind not in COMPUTE]}")
    forwards = [a.mb for a in actions if a.kind == "F"]
    if forwards != list(range(len(forwards))):
        raise ValueError(f"lower needs the forwards in micro-batch order 0, 1, ..., got {forwards}")
    backwards_of = {a.mb for a in actions if a.kind == "B"}
    ahead = in_flight_peak(actions) + 2
    out: list[Action] = []
    posted = backwards = 0

    def post_forwards(upto: int) -> None:  # the activation receives of micro-batches below upto
        nonlocal posted
        while stage > 0 and posted < min(upto, len(forwards)):
            out.append(Action("RECV_F", posted))
            posted += 1

    post_forwards(ahead)
    for a in actions:
        out.append(a)
        if a.kind == "F" and stage < pp - 1:
            out.append(Action("SEND_F", a.mb))
            if a.mb in backwards_of:
                out.append(Action("RECV_B", a.mb))
        elif a.kind == "B":
            backwards += 1
            post_forwards(backwards + ahead)
            if stage > 0:
                out.append(Action("SEND_B", a.mb))
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
    """(makespan, idle time per stage) of the schedule's lowered lists with equal stages."""
    return simulate_lists([lower(schedule(kind, pp, s, m), pp, s) for s in range(pp)], t_f, t_b)


def simulate_lists(lists: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0) -> tuple[float, list[float]]:
    """(makespan, idle time per stage) of running one lowered list per stage.

    A forward costs ``t_f``, a backward ``t_b``, a send or a posted receive nothing. F j (on any
    stage but the first) and B j (on any but the last) start once their stage is free and their
    message was sent (the send's time: the end of the compute before it).

    Raises:
        RuntimeError: the lists deadlock (an action waits on a send that never comes), a compute
            action takes a receive its list did not post before it, or a message is never received.
    """
    pp = len(lists)
    sent: dict[tuple[str, int, int], float] = {}  # (kind, receiving stage, mb) -> the time it was sent
    posted: set[tuple[str, int, int]] = set()
    taken: set[tuple[str, int, int]] = set()
    pos, free, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    while any(pos[s] < len(lists[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if pos[s] == len(lists[s]):
                continue
            a = lists[s][pos[s]]
            if a.kind in ("RECV_F", "RECV_B"):
                posted.add((a.kind[-1], s, a.mb))
            elif a.kind in ("SEND_F", "SEND_B"):
                sent[(a.kind[-1], s + 1 if a.kind == "SEND_F" else s - 1, a.mb)] = free[s]
            else:
                needs = (a.kind, s, a.mb) if (s > 0 if a.kind == "F" else s < pp - 1) else None
                if needs is not None and needs not in posted:
                    raise RuntimeError(f"stage {s}'s {a} takes a receive its list did not post before it")
                if needs is not None and needs not in sent:
                    continue  # waits for the neighbour's send
                start = max(free[s], sent[needs] if needs is not None else 0.0)
                cost = t_f if a.kind == "F" else t_b
                free[s] = start + cost
                busy[s] += cost
                if needs is not None:
                    taken.add(needs)
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"the pipeline's lists deadlock: every stage waits, at positions {pos} "
                               f"({[str(lists[s][pos[s]]) for s in range(pp) if pos[s] < len(lists[s])]})")
    if set(sent) != taken:
        raise RuntimeError(f"messages sent and never received (kind, stage, micro-batch): {sorted(set(sent) - taken)}")
    makespan = max(free)
    return makespan, [makespan - b for b in busy]


def format_table(kind: str, pp: int, m: int) -> str:
    """Every stage's compute actions, one line each, e.g. "stage 0: F0 F1 B0 F2 B1 B2"."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in schedule(kind, pp, s, m)) for s in range(pp))
