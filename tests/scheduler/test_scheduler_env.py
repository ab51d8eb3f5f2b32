"""runtime/scheduler.py: what srun, sbatch and mpirun imply, read from their variables
(recorded from real jobs of SLURM 22.05 and Open MPI 4.1), without a scheduler."""

import os
import shutil
import subprocess
import zlib

import pytest

from runtime import scheduler
from runtime.errors import RingweaveError
from runtime.scheduler import expand_hostlist, expand_tasks_per_node, hnp_address, placement

HOSTLISTS = [
    ("n1", ["n1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[1-3,5],m7", ["n1", "n2", "n3", "n5", "m7"]),
    ("n[01-03]", ["n01", "n02", "n03"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[1,3],cpu[07-08]", ["gpu1", "gpu3", "cpu07", "cpu08"]),
    ("node-[1-2]", ["node-1", "node-2"]),
]


@pytest.mark.parametrize("text, hosts", HOSTLISTS)
def test_a_compressed_host_list_expands_in_order(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-3", "n[1-2]]", "n[3-1]", "n[a]", "n[1-2],,m", "n[[1]]"])
def test_a_malformed_host_list_is_an_error_that_quotes_it(text):
    with pytest.raises(RingweaveError, match="host list"):
        expand_hostlist(text)


def test_the_host_list_parser_agrees_with_scontrol(tmp_path):
    """``scontrol show hostnames`` (only a slurm.conf is needed, no daemon) expands the same lists."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (make slurm installs SLURM)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=parse\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    for text, hosts in HOSTLISTS:
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, SLURM_CONF=str(conf)))
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == hosts == expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [("4", [4]), ("2,1", [2, 1]), ("2(x3),1", [2, 2, 2, 1]),
                                          ("4(x2)", [4, 4]), ("1,3(x2),2", [1, 3, 3, 2])])
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_bad_tasks_per_node_names_the_entry():
    with pytest.raises(RingweaveError, match="'2x3'"):
        expand_tasks_per_node("2x3,1")


# A task of `srun -N 2 -n 3` in job 7 (rank 2, the one task on the second node), as SLURM 22.05 sets it.
SRUN_TASK = {
    "SLURM_JOB_ID": "7", "SLURM_JOBID": "7", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_ON_NODE": "1",
}


def test_an_srun_task_gets_rank_local_sizes_the_first_host_and_a_port_from_the_job_id():
    p = placement(SRUN_TASK)
    assert (p.launcher, p.rank, p.world_size, p.local_rank, p.local_world_size) == ("slurm", 2, 3, 0, 1)
    assert p.master_addr == "n1" and "SLURM_STEP_NODELIST='n[1-2]'" in p.master_addr_source
    assert p.master_port == scheduler.PORT_BASE + 7 and "SLURM_JOB_ID=7" in p.master_port_source
    assert p.job == "slurm-7" and p.restart == 0 and p.threads == 1 and p.problem is None
    assert p.hosts_store is None  # rank 0 hosts it
    first = placement(dict(SRUN_TASK, SLURM_PROCID="0", SLURM_NODEID="0"))
    assert (first.rank, first.local_world_size) == (0, 2)


def test_uneven_and_repeated_tasks_per_node():
    env = dict(SRUN_TASK, SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_STEP_NODELIST="n[01-04]", SLURM_NTASKS="7",
               SLURM_STEP_NUM_TASKS="7", SLURM_STEP_NUM_NODES="4")
    assert [placement(dict(env, SLURM_NODEID=str(i))).local_world_size for i in range(4)] == [2, 2, 2, 1]
    assert placement(env).master_addr == "n01"
    with pytest.raises(RingweaveError, match="SLURM_NODEID=4"):
        placement(dict(env, SLURM_NODEID="4"))


def test_plain_srun_on_one_node_uses_loopback_and_knows_its_local_size():
    """`srun -n 4` sets no SLURM_NTASKS_PER_NODE: local sizes come from SLURM_STEP_TASKS_PER_NODE."""
    env = dict(SRUN_TASK, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_LOCALID="3",
               SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="4", SLURM_TASKS_PER_NODE="4", SLURM_STEP_NODELIST="n1",
               SLURM_JOB_NODELIST="n1", SLURM_STEP_NUM_NODES="1", SLURM_JOB_NUM_NODES="1")
    p = placement(env)
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size) == (3, 4, 3, 4)
    assert p.master_addr == "127.0.0.1" and "one node" in p.master_addr_source


def test_threads_and_restarts_from_slurm():
    p = placement(dict(SRUN_TASK, SLURM_CPUS_PER_TASK="3", SLURM_RESTART_COUNT="2"))
    assert (p.threads, p.restart) == (3, 2)
    assert scheduler.thread_settings(p, {"OMP_NUM_THREADS": "8"}) == {
        "NUMBA_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}  # the user's 8 stays


def test_the_users_variables_win():
    env = dict(SRUN_TASK, MASTER_ADDR="10.0.0.9", MASTER_PORT="29501", RINGWEAVE_JOB="exp", RINGWEAVE_RESTART="5")
    p = placement(env)
    assert (p.master_addr, p.master_addr_source, p.master_port, p.master_port_source) == (
        "10.0.0.9", "MASTER_ADDR", 29501, "MASTER_PORT")
    assert (p.job, p.restart) == ("exp", 5)


def test_the_batch_script_is_told_it_is_not_an_srun_task():
    """sbatch --ntasks=4 runs the script with SLURM_PROCID=0 SLURM_NTASKS=4 but no SLURM_STEP_ID."""
    batch = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n1"}
    p = placement(batch)
    assert p.launcher == "slurm-batch" and "batch script of SLURM job 9" in p.problem and "srun" in p.problem
    one = placement(dict(batch, SLURM_NTASKS="1"))
    assert (one.rank, one.world_size, one.problem) == (0, 1, None)  # a one-task job's script is that task
    assert placement(dict(batch, RANK="0", WORLD_SIZE="1")).problem is None  # the way out it names


# Rank 2 of `mpirun -np 4 --host n2:2,vm:2` run on vm (Open MPI 4.1.4): its local daemon is the HNP.
OMPI_RANK = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_num_nodes": "2", "OMPI_MCA_ess_base_jobid": "782434305",
    "OMPI_MCA_orte_hnp_uri": "782434304.0;tcp://192.0.2.2:50499;tcp6://[fd00::2]:40641",
    "OMPI_MCA_orte_local_daemon_uri": "782434304.0;tcp://192.0.2.2:50499;tcp6://[fd00::2]:40641",
    "PMIX_NAMESPACE": "782434305", "PMIX_RANK": "2",
}


def test_under_mpirun_the_first_rank_on_mpiruns_host_hosts_the_store_there():
    p = placement(OMPI_RANK, cores=2)
    assert (p.launcher, p.rank, p.world_size, p.local_rank, p.local_world_size) == ("openmpi", 2, 4, 0, 2)
    assert p.master_addr == "192.0.2.2" and p.hosts_store is True
    assert p.master_port == scheduler.derived_port(782434305) and p.job == "mpi-782434305"
    assert p.threads == 1  # 2 cores shared by 2 ranks
    remote = dict(OMPI_RANK, OMPI_COMM_WORLD_RANK="0", OMPI_MCA_orte_local_daemon_uri="782434304.1;tcp://10.0.0.2:1")
    assert placement(remote).hosts_store is False and placement(remote).master_addr == "192.0.2.2"
    second = dict(OMPI_RANK, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_LOCAL_RANK="1")
    assert placement(second).hosts_store is False
    given = placement(dict(remote, MASTER_ADDR="n2"))
    assert given.hosts_store is None and given.master_addr == "n2"  # rank 0 hosts at the user's address


def test_mpirun_on_one_node_uses_loopback_and_open_mpi_5_without_an_hnp_needs_master_addr():
    one = dict(OMPI_RANK, OMPI_MCA_orte_num_nodes="1", OMPI_COMM_WORLD_LOCAL_SIZE="4")
    assert placement(one, cores=8).master_addr == "127.0.0.1" and placement(one, cores=8).threads == 2
    prrte = {k: v for k, v in OMPI_RANK.items() if "orte" not in k and "ess" not in k}
    p = placement(prrte)
    assert "MASTER_ADDR is not set" in p.problem and "spans nodes (2 of 4" in p.problem
    assert p.master_port == scheduler.derived_port(zlib.crc32(b"782434305"))
    assert placement(dict(prrte, MASTER_ADDR="n2")).problem is None


def test_hnp_address_prefers_ipv4():
    assert hnp_address("1.0;tcp://10.0.0.1,10.1.0.1:5000;tcp6://[fd00::2]:5001") == "10.0.0.1"
    assert hnp_address("1.0;tcp6://[fd00::2]:5001") == "fd00::2"
    assert hnp_address("") is None


def test_pmi_inside_a_slurm_step_takes_slurms_host_and_port():
    env = dict(SRUN_TASK, PMI_RANK="2", PMI_SIZE="3")
    p = placement(env)
    assert (p.launcher, p.rank, p.world_size, p.master_addr, p.local_world_size) == ("pmi", 2, 3, "n1", 1)
    alone = placement({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert "MASTER_ADDR is not set" in alone.problem


def test_by_hand_and_our_launcher_keep_their_rules():
    p = placement({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    assert (p.launcher, p.master_addr, p.hosts_store, p.threads, p.problem) == ("env", "127.0.0.1", None, None, None)
    launched = placement({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
                          "MASTER_PORT": "29500", "RINGWEAVE_STORE_HOSTED": "1"})
    assert launched.hosts_store is False and launched.problem is None
    assert "spans nodes" in placement({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}).problem
    assert placement({}).launcher == "none"


def test_scontrol_node_addr_is_parsed():
    line = "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.5 NodeHostName=vm Version=22.05.8"
    assert scheduler.parse_slurm_node_addr(line) == "10.0.0.5"
    assert scheduler.parse_slurm_node_addr("Node n9 not found") is None
