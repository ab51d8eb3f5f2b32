"""What the process's launcher already knows: rank, sizes, where the store is, threads.

Pure functions over an environment mapping (``os.environ`` or a dict in tests): no
sockets, no files, no subprocesses. :func:`placement` reads whichever launcher started
this process and returns a :class:`Placement`; runtime/rendezvous.py turns it into a
rendezvous (which resolves the master's name and hosts or joins the store) and
runtime/init.py limits the threads and watches the parent. Launchers, first found wins::

    RANK, WORLD_SIZE [LOCAL_RANK, LOCAL_WORLD_SIZE]        "env"      our launcher, by hand
    the same with TORCHELASTIC_RUN_ID                       "torchrun" a worker that torchrun started
    OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE "openmpi"  Open MPI's mpirun
    PMI_RANK, PMI_SIZE [MPI_LOCALRANKID, MPI_LOCALNRANKS]   "pmi"      MPICH / Intel MPI, srun --mpi=pmi2
    SLURM_PROCID, SLURM_NTASKS with SLURM_STEP_ID           "slurm"    a task that srun started
    SLURM_PROCID, SLURM_NTASKS without SLURM_STEP_ID        "slurm-batch": the batch script itself

Under SLURM the store's host is the step's first node (127.0.0.1 on one node), its port
PORT_BASE + SLURM_JOB_ID mod PORT_SPAN, the restart count SLURM_RESTART_COUNT and the threads
SLURM_CPUS_PER_TASK. Under Open MPI the first local rank on mpirun's own host hosts the store,
found in ``OMPI_MCA_orte_hnp_uri``, on a port from the Open MPI job id. Under torchrun, whose
own store holds MASTER_PORT, rank 0 hosts ours on a port derived from TORCHELASTIC_RUN_ID,
MASTER_ADDR and MASTER_PORT (RINGWEAVE_STORE_PORT wins). The derivations in full: docs/design.md,
"Under a scheduler". MASTER_ADDR and MASTER_PORT in the environment win elsewhere, and say so in
errors (``Placement.master_addr_source``, ``master_port_source``), as ``RINGWEAVE_JOB`` and
``RINGWEAVE_RESTART`` win over the derived job id and restart count.

Not here: acting on any of it (rendezvous.py, init.py), the launcher's own rank environment
(launch.py), watching the parent (lifeline.py).
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from typing import Mapping

from runtime import env
from runtime.errors import RingweaveError

PORT_BASE = 15000  # derived store ports: below Linux's ephemeral range (32768+), which outgoing connections take
PORT_SPAN = 10000  # job ids 10000 apart share a port; a busy port is a clear error naming it
THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    """This process in its job, as its launcher describes it (see the module docstring)."""
    launcher: str                        # "env" | "torchrun" | "openmpi" | "pmi" | "slurm" | "slurm-batch" | "none"
    rank: int | None = None              # e.g. 5
    world_size: int | None = None        # e.g. 8
    local_rank: int | None = None        # e.g. 1
    local_world_size: int | None = None  # ranks on this node, e.g. 4
    master_addr: str | None = LOOPBACK   # the store's host, e.g. "n01" (None: unknown)
    master_addr_source: str = "default"  # e.g. "the first host of SLURM_STEP_NODELIST='n[01-04]'"
    master_port: int | None = None       # e.g. 15042
    master_port_source: str = "unset"    # e.g. "SLURM_JOB_ID=5042: 15000 + 5042 mod 10000"
    hosts_store: bool | None = None      # True/False: this process does/does not host it; None: rank 0 does
    job: str | None = None               # e.g. "slurm-5042"; None: the runtime's default
    restart: int = 0                     # attempts before this one
    threads: int | None = None           # threads per rank the launcher implies; None: leave them alone
    problem: str | None = None           # why this process must not join as it is (init raises it)
    nodelist: tuple[str, ...] = ()       # SLURM: the step's hosts, e.g. ("n01", "n02")


# -- the pieces: host lists, tasks per node, ports ---------------------------------------------


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded in order, as ``scontrol show hostnames`` does.

    ``"n[1-3,5],m7"`` -> n1 n2 n3 n5 m7; ``"n[01-03]"`` -> n01 n02 n03 (a range keeps its lower
    bound's width); ``"r[1-2]n[1-2]"`` -> r1n1 r1n2 r2n1 r2n2 (brackets multiply, the last varies
    fastest); ``"n[1-2]-ib"`` -> n1-ib n2-ib.

    Raises:
        RingweaveError: an unbalanced bracket, an empty entry or a range that is not
            ``a`` or ``a-b`` with a <= b; the message quotes the list.
    """
    hosts: list[str] = []
    for entry in _split_top_level(text):
        if not entry:
            raise RingweaveError(f"host list {text!r} has an empty entry")
        hosts.extend(_expand_entry(entry, text))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets: "n[1,3],m" -> ["n[1,3]", "m"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise RingweaveError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise RingweaveError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise RingweaveError(f"host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return [p.strip() for p in parts] if text.strip() else []


def _expand_entry(entry: str, text: str) -> list[str]:
    """One entry with any number of bracket groups: their cartesian product, in order."""
    open_at = entry.find("[")
    if open_at < 0:
        return [entry]
    close_at = entry.index("]", open_at)
    prefix, body, rest = entry[:open_at], entry[open_at + 1:close_at], entry[close_at + 1:]
    numbers: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise RingweaveError(f"host list {text!r}: {item!r} in [{body}] is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise RingweaveError(f"host list {text!r}: range {item!r} runs backwards")
        width = len(lo)
        numbers.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    tails = _expand_entry(rest, text)
    return [f"{prefix}{n}{tail}" for n in numbers for tail in tails]


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks (or CPUs) per node, one entry per node: ``"2(x3),1"`` -> [2, 2, 2, 1].

    Raises:
        RingweaveError: an entry that is not ``n`` or ``n(xk)``.
    """
    out: list[int] = []
    for item in text.split(","):
        m = _TASKS.match(item.strip())
        if not m:
            raise RingweaveError(f"tasks per node {text!r}: {item!r} is not 'n' or 'n(xk)'")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def derived_port(key: int) -> int:
    """The store port a job id gives: ``PORT_BASE + key mod PORT_SPAN``."""
    return PORT_BASE + key % PORT_SPAN


# -- reading the environment ---------------------------------------------------------------------


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RingweaveError(f"environment variable {name}={value!r} is not an integer") from None


def _first_int(environ: Mapping[str, str], name: str) -> int | None:
    """The first count of a SLURM per-node list variable ("4(x2)" -> 4), for the old SLURM_NTASKS_PER_NODE."""
    value = environ.get(name)
    if not value:
        return None
    return expand_tasks_per_node(value)[0]


def placement(environ: Mapping[str, str], cores: int = 1) -> Placement:
    """This process's placement from ``environ`` (see the module docstring); ``cores``: the CPUs
    this process may run on (its affinity), for the Open MPI thread count.

    Raises:
        RingweaveError: a variable that should be a number, host list or task list is not;
            the message names it. A process that must not join as it is (a SLURM batch
            step with several tasks, a multi-node job whose store host is unknown) is not
            an error here: ``Placement.problem`` says why, and ``runtime.init`` raises it.
    """
    if _int(environ, "RANK") is not None and _int(environ, "WORLD_SIZE") is not None:
        p = _torchrun(environ) if is_torchrun(environ) else _generic(environ)
    elif _int(environ, "OMPI_COMM_WORLD_RANK") is not None and _int(environ, "OMPI_COMM_WORLD_SIZE") is not None:
        p = _openmpi(environ, cores)
    elif _int(environ, "PMI_RANK") is not None and _int(environ, "PMI_SIZE") is not None:
        p = _pmi(environ)
    elif _int(environ, "SLURM_PROCID") is not None and _int(environ, "SLURM_NTASKS") is not None:
        p = _slurm(environ)
    else:
        p = Placement("none")
    return _overrides(environ, p)


def _overrides(environ: Mapping[str, str], p: Placement) -> Placement:
    """MASTER_ADDR / MASTER_PORT / RINGWEAVE_JOB / RINGWEAVE_RESTART set by the user win (torchrun's
    MASTER_* are its own store's: :func:`_torchrun` read them); a store our launcher hosts
    (RINGWEAVE_STORE_HOSTED=1) is hosted by no rank."""
    fields: dict = {}
    if environ.get("MASTER_ADDR") and p.launcher != "torchrun":
        fields.update(master_addr=environ["MASTER_ADDR"], master_addr_source="MASTER_ADDR", hosts_store=None)
    elif p.master_addr is None:
        fields.update(master_addr=LOOPBACK, problem=p.problem or (
            f"MASTER_ADDR is not set and this {p.launcher} job spans nodes ({p.local_world_size} of "
            f"{p.world_size} ranks on this one): set MASTER_ADDR to the host of rank 0 (the default, "
            f"127.0.0.1, is right on one node only)"))
    port = _master_port(environ)
    if port is not None and p.launcher != "torchrun":
        fields.update(master_port=port, master_port_source="MASTER_PORT")
    if env.STORE_HOSTED.get(environ):
        fields["hosts_store"] = False
    if env.JOB.given(environ) is not None:
        fields["job"] = env.JOB.get(environ)
    if env.RESTART.given(environ) is not None:
        fields["restart"] = env.RESTART.get(environ)
    return _replace(p, **fields)


def _master_port(environ: Mapping[str, str]) -> int | None:
    port = _int(environ, "MASTER_PORT")
    if port is not None and not 0 <= port <= 65535:  # a socket call would take it modulo 65536: another port
        raise RingweaveError(f"environment variable MASTER_PORT={port} is not a port: it must be in 1..65535")
    return port


def _replace(p: Placement, **fields) -> Placement:
    return Placement(**{**p.__dict__, **fields})


def _where_rank0(world_size: int, local_world_size: int | None) -> tuple[str | None, str]:
    """(MASTER_ADDR, its source) where the launcher does not say where rank 0 is: loopback
    unless this node holds only some of the ranks (None: unknown, MASTER_ADDR is needed)."""
    if local_world_size is not None and local_world_size < world_size:
        return None, "unknown"
    return LOOPBACK, "default (one node)"


def _generic(environ: Mapping[str, str]) -> Placement:
    rank, size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_size = _int(environ, "LOCAL_WORLD_SIZE")
    addr, source = _where_rank0(size, local_size)
    return Placement("env", rank, size, _int(environ, "LOCAL_RANK"), local_size, addr, source)


def is_torchrun(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is a torchrun worker's (TORCHELASTIC_RUN_ID), not a rank of our launcher
    run inside one (RINGWEAVE_STORE_HOSTED=1: the launcher's store is the one to meet)."""
    return bool(environ.get("TORCHELASTIC_RUN_ID")) and not env.STORE_HOSTED.get(environ)


def torchrun_port(run_id: str, master_addr: str, master_port: int | None) -> int:
    """Our store's port under torchrun, the same on every worker of one rendezvous round:
    ``PORT_BASE + crc32("<run id>\\0<MASTER_ADDR>\\0<MASTER_PORT>") mod PORT_SPAN``."""
    return derived_port(zlib.crc32(f"{run_id}\x00{master_addr}\x00{master_port}".encode()))


def _torchrun(environ: Mapping[str, str]) -> Placement:
    """A worker of torchrun. MASTER_ADDR:MASTER_PORT is torchrun's own store (its agent's, with
    TORCHELASTIC_USE_AGENT_STORE=True) or a port left for torch's (False): ours never takes it.
    Rank 0 (GROUP_RANK 0, LOCAL_RANK 0, on MASTER_ADDR's host) hosts ours on a port every worker
    derives (:func:`torchrun_port`) unless RINGWEAVE_STORE_PORT gives one; on one node on
    127.0.0.1. The restart count stays 0: torchrun's is each agent's own (an agent restarted
    because another node failed does not count it), and our store is new in every attempt anyway."""
    p = _generic(environ)
    run_id, addr, port = environ["TORCHELASTIC_RUN_ID"], environ.get("MASTER_ADDR", ""), _master_port(environ)
    fields: dict = {"launcher": "torchrun", "job": f"torchrun-{run_id}"}
    if p.master_addr == LOOPBACK:  # every worker is on this node (LOCAL_WORLD_SIZE == WORLD_SIZE)
        fields["master_addr_source"] = "127.0.0.1 (every torchrun worker runs on this node)"
    elif addr:
        fields.update(master_addr=addr, master_addr_source="torchrun's MASTER_ADDR (the host of rank 0)")
    given = env.STORE_PORT.given(environ)
    if given is not None:
        fields.update(master_port=given, master_port_source=env.STORE_PORT.name)
    else:
        fields.update(master_port=torchrun_port(run_id, addr, port), master_port_source=(
            f"derived from TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT={port} (torchrun's own store's): "
            f"{PORT_BASE} + crc32 mod {PORT_SPAN}"))
    return _replace(p, **fields)


def _openmpi(environ: Mapping[str, str], cores: int) -> Placement:
    rank, size = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
    local_rank, local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    jobid = _int(environ, "OMPI_MCA_ess_base_jobid")
    if jobid is None and environ.get("PMIX_NAMESPACE"):
        jobid = zlib.crc32(environ["PMIX_NAMESPACE"].encode())
    fields: dict = {}
    nodes = _int(environ, "OMPI_MCA_orte_num_nodes")
    if nodes == 1 or (local_size is not None and local_size == size):
        fields.update(master_addr=LOOPBACK, master_addr_source="127.0.0.1 (every rank runs on mpirun's node)")
    else:
        hnp = hnp_address(environ.get("OMPI_MCA_orte_hnp_uri", ""))
        if hnp is None:
            addr, source = _where_rank0(size, local_size)
            fields.update(master_addr=addr, master_addr_source=source)
        else:
            on_hnp = environ.get("OMPI_MCA_orte_local_daemon_uri", "").split(";")[0].endswith(".0")
            fields.update(master_addr=hnp, hosts_store=on_hnp and local_rank == 0,
                          master_addr_source="mpirun's host, from OMPI_MCA_orte_hnp_uri "
                                             "(the store is hosted by the first rank there)")
    if jobid is not None:
        fields.update(master_port=derived_port(jobid), job=f"mpi-{jobid}",
                      master_port_source=f"the Open MPI job id {jobid}: {PORT_BASE} + id mod {PORT_SPAN}")
    threads = max(1, cores // local_size) if local_size else 1
    return Placement("openmpi", rank, size, local_rank, local_size, threads=threads, **fields)


def hnp_address(uri: str) -> str | None:
    """The first TCP address in an Open MPI contact URI, IPv4 first:
    ``"123.0;tcp://10.0.0.1,10.1.0.1:5000;tcp6://[fd00::2]:5001"`` -> "10.0.0.1"."""
    v4, v6 = [], []
    for part in uri.split(";")[1:]:
        scheme, _, rest = part.partition("://")
        hosts = rest.rsplit(":", 1)[0] if rest else ""
        for host in filter(None, hosts.split(",")):
            (v4 if scheme == "tcp" else v6 if scheme == "tcp6" else []).append(host.strip("[]"))
    return (v4 + v6)[0] if v4 or v6 else None


def _pmi(environ: Mapping[str, str]) -> Placement:
    rank, size = _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE")
    local_rank, local_size = _int(environ, "MPI_LOCALRANKID"), _int(environ, "MPI_LOCALNRANKS")
    if environ.get("SLURM_STEP_ID") is not None and environ.get("SLURM_JOB_ID"):  # srun --mpi=pmi2, Hydra in SLURM
        s = _slurm_task(environ, size)
        return _replace(s, launcher="pmi", rank=rank, world_size=size,
                        local_rank=local_rank if local_rank is not None else s.local_rank,
                        local_world_size=local_size if local_size is not None else s.local_world_size)
    addr, source = _where_rank0(size, local_size)
    return Placement("pmi", rank, size, local_rank, local_size, addr, source)


def _slurm(environ: Mapping[str, str]) -> Placement:
    if environ.get("SLURM_STEP_ID") is None and environ.get("SLURM_STEPID") is None:
        return _slurm_batch(environ)
    s = _slurm_task(environ, _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS"))
    return _replace(s, rank=_int(environ, "SLURM_PROCID"))


def _slurm_batch(environ: Mapping[str, str]) -> Placement:
    """The batch script itself (sbatch): it inherits SLURM_PROCID=0 and SLURM_NTASKS, but srun
    started nothing, so no other rank will come."""
    ntasks = _int(environ, "SLURM_NTASKS")
    job = environ.get("SLURM_JOB_ID", "?")
    if ntasks == 1:
        return Placement("slurm-batch", 0, 1, 0, 1, job=f"slurm-{job}", threads=_slurm_threads(environ))
    return Placement("slurm-batch", problem=(
        f"this process is the batch script of SLURM job {job}, not a task that srun started "
        f"(SLURM_PROCID=0 and SLURM_NTASKS={ntasks} come from sbatch; SLURM_STEP_ID is unset), so no other "
        f"rank will join it: start the ranks with `srun python ...`, or set WORLD_SIZE=1 RANK=0 to run a single "
        f"process here"))


def _slurm_threads(environ: Mapping[str, str]) -> int:
    return _int(environ, "SLURM_CPUS_PER_TASK") or 1


def _slurm_task(environ: Mapping[str, str], world_size: int | None) -> Placement:
    nodelist_var = "SLURM_STEP_NODELIST" if environ.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    hosts = tuple(expand_hostlist(environ.get(nodelist_var, "")))
    per_node_var = "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    local_size = None
    if environ.get(per_node_var):
        per_node = expand_tasks_per_node(environ[per_node_var])
        node = _int(environ, "SLURM_NODEID") or 0
        if node >= len(per_node):
            raise RingweaveError(f"SLURM_NODEID={node} but {per_node_var}={environ[per_node_var]!r} lists "
                                 f"{len(per_node)} node(s)")
        local_size = per_node[node]
    else:
        local_size = _first_int(environ, "SLURM_NTASKS_PER_NODE")
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES") or _int(environ, "SLURM_JOB_NUM_NODES") or len(hosts) or None
    if nnodes == 1 or (local_size is not None and local_size == world_size):
        addr, source = LOOPBACK, "127.0.0.1 (the step runs on one node)"
    elif hosts:
        addr, source = hosts[0], f"the first host of {nodelist_var}={environ[nodelist_var]!r}"
    else:
        addr, source = LOOPBACK, "default"
    fields: dict = {}
    job = _int(environ, "SLURM_JOB_ID")
    if job is not None:
        fields.update(master_port=derived_port(job), job=f"slurm-{job}",
                      master_port_source=f"SLURM_JOB_ID={job}: {PORT_BASE} + id mod {PORT_SPAN}")
    return Placement("slurm", None, world_size, _int(environ, "SLURM_LOCALID"), local_size, addr, source,
                     restart=_int(environ, "SLURM_RESTART_COUNT") or 0, threads=_slurm_threads(environ),
                     nodelist=hosts, **fields)


def slurm_members(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """An elastic job's first generation under srun (runtime/elastic.py), one member id per task in
    SLURM_PROCID order: ``slurm-<job>.<step>/r<task>/a<restart>``, e.g. "slurm-42.0/r1/a0"; None
    outside a task of srun. Every task derives the same ids, so no launcher needs to record them."""
    ids = _slurm_task_ids(environ)
    if ids is None:
        return None
    job, step, ntasks = ids
    restart = _int(environ, "SLURM_RESTART_COUNT") or 0
    return tuple(f"slurm-{job}.{step}/r{r}/a{restart}" for r in range(ntasks))


def _slurm_task_ids(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(job id, step id, tasks) of a task that srun started, or None."""
    job = _int(environ, "SLURM_JOB_ID")
    step = _int(environ, "SLURM_STEP_ID") if environ.get("SLURM_STEP_ID") else _int(environ, "SLURM_STEPID")
    ntasks = _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS")
    if job is None or step is None or not ntasks or _int(environ, "SLURM_PROCID") is None:
        return None
    return job, step, ntasks


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def thread_settings(p: Placement, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread variables to set: each of THREAD_VARS that ``environ`` leaves unset or empty,
    to ``p.threads``; nothing where the launcher implies no count (by hand, our launcher,
    which sets them itself)."""
    if p.threads is None:
        return {}
    return {name: str(p.threads) for name in THREAD_VARS if not environ.get(name)}


def parse_slurm_node_addr(scontrol_output: str) -> str | None:
    """NodeAddr from ``scontrol show node NAME -o`` (one line of key=value pairs)."""
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", scontrol_output)
    return m.group(1) if m else None
