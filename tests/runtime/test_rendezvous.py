"""The rendezvous seam (runtime/rendezvous.py): which implementation each launcher's environment
gives and what it reads from it (pure, from a dict), and generations: the same members forming
generation 0 then 1 on one store, with runtime.init wired again on generation 1 (under the
launcher: tests/runtime/test_init.py)."""

import asyncio
import socket

import msgpack
import numpy as np
import pytest

import runtime
from runtime import rendezvous
from runtime.errors import ClosedError, RingweaveError, StoreTimeoutError
from runtime.rendezvous import (EnvRendezvous, LauncherRendezvous, Membership, MpirunRendezvous, Seat,
                                SingleRendezvous, SlurmRendezvous, StoreRendezvous, TorchrunRendezvous)
from runtime.store import MemoryStore

pytestmark = pytest.mark.timeout(60)
ALL_THREADS = {name: "1" for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "MKL_NUM_THREADS")}

# -- which implementation, and what it reads: one case per launcher ---------------------------------------

LAUNCHER = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RINGWEAVE_STORE_HOSTED": "1",
            "RINGWEAVE_JOB": "job-x", "RINGWEAVE_RESTART": "2"}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "ROLE_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
BY_HAND = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}
SRUN_RANK0 = {  # rank 0 of `srun -N 2 -n 3` in job 7, as SLURM 22.05 sets it
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_RESTART_COUNT": "1"}
OMPI_RANK2 = {  # rank 2 of `mpirun -np 4 --host n2:2,vm:2` run on vm (Open MPI 4.1): its local daemon is the HNP
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_num_nodes": "2", "OMPI_MCA_ess_base_jobid": "782434305",
    "OMPI_MCA_orte_hnp_uri": "782434304.0;tcp://192.0.2.2:50499",
    "OMPI_MCA_orte_local_daemon_uri": "782434304.0;tcp://192.0.2.2:50499"}
PMI_ONE_NODE = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "29502"}

CASES = {
    "launcher": (LAUNCHER, LauncherRendezvous, Seat(
        3, 4, 1, 2, "127.0.0.1", 29500, hosts_store=False, job="job-x", restart=2, addr_source="MASTER_ADDR",
        port_source="MASTER_PORT")),
    "launcher-rank-0": (dict(LAUNCHER, RANK="0", LOCAL_RANK="0"), LauncherRendezvous, Seat(
        0, 4, 0, 2, "127.0.0.1", 29500, hosts_store=False, job="job-x", restart=2, addr_source="MASTER_ADDR",
        port_source="MASTER_PORT")),
    "torchrun": (TORCHRUN, TorchrunRendezvous, Seat(
        0, 2, 0, 2, "127.0.0.1", 29400, hosts_store=True, job="ringweave", restart=0, addr_source="MASTER_ADDR",
        port_source="MASTER_PORT")),
    "by-hand": (BY_HAND, EnvRendezvous, Seat(
        1, 2, None, None, "10.0.0.1", 29501, hosts_store=False, addr_source="MASTER_ADDR", port_source="MASTER_PORT")),
    "by-hand-rank-0": (dict(BY_HAND, RANK="0"), EnvRendezvous, Seat(
        0, 2, None, None, "10.0.0.1", 29501, hosts_store=True, addr_source="MASTER_ADDR", port_source="MASTER_PORT")),
    "srun": (SRUN_RANK0, SlurmRendezvous, Seat(
        0, 3, 0, 2, "n1", 15007, hosts_store=True, job="slurm-7", restart=1,
        addr_source="the first host of SLURM_STEP_NODELIST='n[1-2]'", port_source="SLURM_JOB_ID=7: 15000 + id mod 10000",
        threads=ALL_THREADS, nodelist=("n1", "n2"))),
    "srun-pmi2": (dict(SRUN_RANK0, PMI_RANK="2", PMI_SIZE="3", SLURM_PROCID="2", SLURM_NODEID="1"), SlurmRendezvous,
                  Seat(2, 3, 0, 1, "n1", 15007, hosts_store=False, job="slurm-7", restart=1,
                       addr_source="the first host of SLURM_STEP_NODELIST='n[1-2]'",
                       port_source="SLURM_JOB_ID=7: 15000 + id mod 10000", threads=ALL_THREADS, nodelist=("n1", "n2"))),
    "mpirun": (OMPI_RANK2, MpirunRendezvous, Seat(
        2, 4, 0, 2, "192.0.2.2", 15000 + 782434305 % 10000, hosts_store=True, job="mpi-782434305", restart=0,
        addr_source="mpirun's host, from OMPI_MCA_orte_hnp_uri (the store is hosted by the first rank there)",
        port_source="the Open MPI job id 782434305: 15000 + id mod 10000", threads=ALL_THREADS)),
    "mpirun-second-local-rank": (dict(OMPI_RANK2, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_LOCAL_RANK="1"),
                                 MpirunRendezvous, Seat(
        3, 4, 1, 2, "192.0.2.2", 15000 + 782434305 % 10000, hosts_store=False, job="mpi-782434305", restart=0,
        addr_source="mpirun's host, from OMPI_MCA_orte_hnp_uri (the store is hosted by the first rank there)",
        port_source="the Open MPI job id 782434305: 15000 + id mod 10000", threads=ALL_THREADS)),
    "pmi": (PMI_ONE_NODE, MpirunRendezvous, Seat(
        1, 2, 1, 2, "127.0.0.1", 29502, hosts_store=False, addr_source="default (one node)",
        port_source="MASTER_PORT")),
    "nothing": ({}, SingleRendezvous, Seat(0, 1, hosts_store=True, addr_source="default")),
    "one-srun-task": (dict(SRUN_RANK0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1",
                           SLURM_STEP_NODELIST="n1", SLURM_STEP_NUM_NODES="1"), SingleRendezvous, Seat(
        0, 1, 0, 1, "127.0.0.1", 15007, hosts_store=True, job="slurm-7", restart=1,
        addr_source="127.0.0.1 (the step runs on one node)", port_source="SLURM_JOB_ID=7: 15000 + id mod 10000",
        threads=ALL_THREADS, nodelist=("n1",))),
}


@pytest.mark.parametrize("name", CASES)
def test_each_launcher_gives_its_rendezvous_and_seat(name):
    environ, cls, seat = CASES[name]
    got = rendezvous.from_env(environ, cores=2)
    assert type(got) is cls and got.kind == cls.kind
    assert got.seat == seat


def test_the_arguments_win_and_a_given_store_is_a_store_rendezvous():
    got = rendezvous.from_env(dict(BY_HAND, RINGWEAVE_STORE_HOSTED="1"), rank=0, master_port=1234, job="j")
    assert type(got) is LauncherRendezvous
    assert (got.seat.rank, got.seat.master_port, got.seat.port_source, got.seat.hosts_store, got.seat.job) == (
        0, 1234, "the master_port argument", False, "j")
    by_args = rendezvous.from_env({}, rank=0, world_size=2, master_port=1234)
    assert type(by_args) is EnvRendezvous and by_args.seat.hosts_store and by_args.seat.master_addr == "127.0.0.1"
    given = rendezvous.from_env(SRUN_RANK0, rank=1, world_size=3, store=MemoryStore(1))
    assert type(given) is StoreRendezvous and not given.process_of_job
    assert (given.seat.rank, given.seat.job, given.seat.restart) == (1, "slurm-7", 1)


@pytest.mark.parametrize("environ, kw, message", [
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, {}, "batch script of SLURM job 9"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, {}, "MASTER_PORT is not set"),
    ({}, {"world_size": 4}, "rank is None and world size 4: give both"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, {}, "rank 2 is outside 0..1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "RANK='x'"),
])
def test_a_process_that_cannot_join_is_told_why_before_any_io(environ, kw, message):
    with pytest.raises(RingweaveError, match=message):
        rendezvous.from_env(environ, **kw)


def test_generation_namespaces():
    assert rendezvous.generation_prefix(0, 0) == "restart/0"  # where the launcher and tools look
    assert rendezvous.generation_prefix(3, 2) == "restart/3/gen/2"


# -- generations -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_members(n: int, port: int) -> list[rendezvous.Rendezvous]:
    """n members started by hand on loopback (rank 0 hosts the store), with a secret."""
    return [rendezvous.from_env({"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_PORT": str(port)}, secret=b"s" * 32)
            for r in range(n)]


async def shut_all(members) -> None:
    await asyncio.gather(*(m.shutdown() for m in reversed(members)))  # the host lingers for the others


async def test_the_same_members_form_generation_0_then_1_on_one_store():
    members = tcp_members(3, free_port())
    try:
        for generation in (0, 1):
            got: list[Membership] = await asyncio.gather(*(m.next_rendezvous(10) for m in members))
            assert [(g.rank, g.world_size, g.generation) for g in got] == [(r, 3, generation) for r in range(3)]
            assert {g.store.prefix for g in got} == {rendezvous.generation_prefix(0, generation)}
            await got[2].store.set("hello", f"from 2 in {generation}".encode())
            assert [await g.store.get("hello", 5) for g in got] == [f"from 2 in {generation}".encode()] * 3
            await got[0].store.add("shutdown", 1)  # a key every generation uses: each has its own
            assert int(await got[1].store.get("shutdown", 5)) == 1
            info = msgpack.unpackb(await got[1].store.store.get(rendezvous.JOB_INFO_KEY, 5))
            assert info == {"world_size": 3, "restart": 0, "generation": generation}
        assert members[0].hosts_store and not members[1].hosts_store
    finally:
        await shut_all(members)
    with pytest.raises(ClosedError, match="was shut down"):
        await members[1].next_rendezvous(1)


async def _ring(rt) -> int:
    """Every rank sends its rank to the next and returns what came from the one before."""
    await rt.actor.send((rt.rank + 1) % rt.world_size, "ring", np.full(4, rt.rank, np.int64))
    got = np.empty(4, np.int64)
    await rt.actor.recv_into((rt.rank - 1) % rt.world_size, "ring", got)
    return int(got[0])


async def test_init_wires_the_runtime_again_on_generation_1(monkeypatch):
    """Two ranks as tasks of this process, a real TCP store hosted by rank 0: init, a ring,
    an orderly shutdown (its counter is per generation), then all of it again on generation 1."""
    monkeypatch.setenv("RINGWEAVE_WATCH_PARENT", "0")
    members = tcp_members(2, free_port())

    async def rank(rdzv):
        seen = []
        for _ in range(2):
            rt = await runtime.init(rendezvous=rdzv, timeout_s=20)
            seen.append((rt.generation, rt.store.prefix, await _ring(rt)))
            await runtime.shutdown(rt, exc=None)
            assert rt._closed and not rdzv._closed  # the caller's rendezvous stays for the next generation
        return seen

    try:
        assert await asyncio.wait_for(asyncio.gather(*(rank(m) for m in members)), 40) == [
            [(0, "restart/0", 1), (1, "restart/0/gen/1", 1)], [(0, "restart/0", 0), (1, "restart/0/gen/1", 0)]]
    finally:
        await shut_all(members)


async def test_a_member_out_of_step_times_out_naming_the_ranks_that_have_not_joined():
    store = MemoryStore(10)
    members = [rendezvous.from_env({}, rank=r, world_size=2, store=store) for r in range(2)]
    await members[0].next_rendezvous(1)  # rank 0 alone forms its generation 0: it is one ahead

    async def join(rdzv):
        return await runtime.init(rendezvous=rdzv, timeout_s=0.5)

    results = await asyncio.gather(*(join(m) for m in members), return_exceptions=True)
    assert all(isinstance(r, StoreTimeoutError) for r in results), results
    assert "generation 1" in str(results[0]) and "not joined: rank 1 (joined: rank 0)" in str(results[0])
    assert "not joined: rank 0 (joined: rank 1)" in str(results[1])
    assert not any("addr/" in str(r) or "restart/" in str(r) for r in results), results  # no store keys
    assert results[0].keys == ["restart/0/gen/1/addr/1"]  # the keys stay for a program that wants them


async def test_a_rendezvous_takes_no_other_placement():
    rdzv = rendezvous.from_env({}, rank=0, world_size=1, store=MemoryStore(1))
    with pytest.raises(RingweaveError, match="give none of them"):
        await runtime.init(rank=0, rendezvous=rdzv)


async def test_a_rank_alone_over_tcp_times_out_naming_the_rank_that_has_not_joined(monkeypatch):
    """Rank 0 of 2 hosts the store and nobody else comes: the message says which rank, in words."""
    monkeypatch.setenv("RINGWEAVE_WATCH_PARENT", "0")
    with pytest.raises(StoreTimeoutError) as caught:
        await runtime.init(rank=0, world_size=2, master_addr="127.0.0.1", master_port=free_port(), timeout_s=0.5)
    message = str(caught.value)
    assert "rank 0 of 2" in message and "not joined: rank 1 (joined: rank 0)" in message, message
    assert "addr/" not in message and "restart/" not in message and "keys" not in message, message
