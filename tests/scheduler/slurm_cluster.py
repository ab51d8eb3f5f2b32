"""A private two-node SLURM cluster on this machine, for tests: munged, slurmctld and two
slurmd (``slurmd -N n1`` and ``-N n2`` on their own ports, as Debian's build allows), with
a config, state, spool, logs and munge key of their own in a temporary directory. Nothing
outside it is read or written (``SLURM_CONF`` points every client at it).

    cluster = SlurmCluster(tmp_dir); cluster.start()      # waits until both nodes are idle
    cluster.run(["srun", "-n", "4", "python", ...])         # clients with the cluster's environment
    cluster.stop()                                          # cancels jobs, stops the daemons and
                                                            # whatever their jobs left behind

The nodes are named n1 and n2 (SLURM_JOB_NODELIST reads "n[1-2]", as on a real cluster) and
both live at 127.0.0.1 (NodeAddr): names that do not resolve, so the runtime takes the
address SLURM has for them. Each claims 8 CPUs whatever the machine has (config_overrides).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from runtime.scheduler import THREAD_VARS
from tests.scheduler.jobs import VENV_BIN, alive, free_port, kill_all

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
START_TIMEOUT_S = 60.0


def slurm_missing() -> str | None:
    """Why a cluster cannot be started here (None: it can)."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): `make slurm` installs it with apt"
    if os.geteuid() != 0:
        return "the SLURM tests start slurmd, which must run as root"
    return None


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    # -- the environment of clients and jobs ------------------------------------------------

    @property
    def env(self) -> dict:
        """os.environ with this cluster's SLURM_CONF and this interpreter's bin first on PATH
        (so `python` in a job is the test's Python), without variables of other jobs or threads."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in THREAD_VARS}
        return dict(env, SLURM_CONF=str(self.conf), PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")

    def run(self, cmd, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        out = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kw)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, cmd))} exited {out.returncode}: {out.stderr[-2000:]}")
        return out

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, states, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            assert time.monotonic() < deadline, (f"job {job_id} is {info.get('JobState')} after {timeout_s:.0f} s, "
                                                 f"not in {states}: {info}")
            time.sleep(0.2)

    # -- start and stop ------------------------------------------------------------------------

    def start(self) -> None:
        for d in ("munge", "state", "spool/n1", "spool/n2", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o711)
        key = self.root / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        m = self.root / "munge"
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={m / 'pid'}", f"--seed-file={m / 'seed'}", f"--log-file={m / 'log'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        ctld_port, n1_port, n2_port = free_port(), free_port(), free_port()
        self.conf.write_text(self._config(ctld_port, {"n1": n1_port, "n2": n2_port}))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in ("n1", "n2"):
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._idle, "both nodes to be idle")

    def _config(self, ctld_port: int, nodes: dict[str, int]) -> str:
        r = self.root
        lines = [
            "ClusterName=ringweave-test",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd'}.%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log'}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            # a requeued job becomes eligible after cred_expire; the scheduler looks every sched_interval s
            "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=1",
            "ReturnToService=2", "SlurmdParameters=config_overrides",
            "KillWait=10", "InactiveLimit=0", "MinJobAge=600", "MailProg=/bin/true",
        ]
        for node, port in nodes.items():
            lines.append(f"NodeName={node} NodeHostname={socket.gethostname().split('.')[0]} NodeAddr=127.0.0.1 "
                         f"Port={port} CPUs=8 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def _idle(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.logs()}")
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and states.get("n1") == "idle" and states.get("n2") == "idle"

    def _wait(self, predicate, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test SLURM cluster did not come up: no {what} after "
                                   f"{START_TIMEOUT_S:.0f} s\n{self.logs()}")
            time.sleep(0.1)

    def state(self) -> str:
        """What a failed wait needs: the queue with each job's state and reason, the nodes, the logs."""
        queue = self.run(["squeue", "-h", "-o", "%i %T %r %N"], check=False, timeout=30)
        nodes = self.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], check=False, timeout=30)
        return f"--- squeue\n{queue.stdout}{queue.stderr}--- sinfo\n{nodes.stdout}{nodes.stderr}{self.logs()}"

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels every job, stops the daemons, and kills what is left of this cluster's jobs
        (processes whose environment names this cluster's SLURM_CONF: slurmstepd, tasks)."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                ids = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=30).stdout.split()
                if ids:
                    self.run(["scancel", *ids], check=False, timeout=30)
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline and self.run(
                            ["squeue", "-h", "-t", "R,CG", "-o", "%i"], check=False, timeout=30).stdout.strip():
                        time.sleep(0.2)
        finally:
            for name in ("slurmd-n1", "slurmd-n2", "slurmctld", "munged"):
                proc = self.procs.get(name)
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            kill_all(self._our_processes())
            for log in self._logs:
                log.close()

    def _our_processes(self) -> list[int]:
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0") and alive(int(entry)):
                        pids.append(int(entry))
            except OSError:
                continue
        return pids
