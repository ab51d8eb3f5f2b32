"""Smoke tests of bench/netem.py: 2 ranks in 2 network namespaces behind 1 Gbit/s links run
bench/collectives.py (alone, and beside Gloo and Open MPI between the hosts) and the trainer;
the table, the JSON and the default algorithm across hosts are checked. Whatever ends a run (its
end, SIGTERM, SIGINT; SIGKILL and then --cleanup), every namespace, link and process it made is
gone afterwards, and nothing of anyone else's, the delay line in user space (bench/_delayline.py)
and its iptables rules included. They assert that the harness works, never a speed: the added
delay is a floor under a round trip. Need root, ip, tc and unshare (and iptables for the delay
line); skipped with the reason otherwise. The delay line's netlink messages are checked without root."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import struct

import pytest

ROOT = Path(__file__).resolve().parents[2]
# loaded from its file: with bench/ on sys.path, "import collectives" would find bench/collectives.py
_spec = importlib.util.spec_from_file_location("bench_netem", ROOT / "bench" / "netem.py")
netem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netem)

WHY_NOT = netem.why_not()
if WHY_NOT is None:
    probe = f"rwprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        WHY_NOT = f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
NO_QUEUE = WHY_NOT or (None if shutil.which("iptables") else "no iptables (the delay line's NFQUEUE rules)")
needs_queue = pytest.mark.skipif(NO_QUEUE is not None, reason=NO_QUEUE or "")
_spec_line = importlib.util.spec_from_file_location("bench_delayline", ROOT / "bench" / "_delayline.py")
delayline = importlib.util.module_from_spec(_spec_line)
_spec_line.loader.exec_module(delayline)


def start(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / "netem.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """Waits for a run; asserts it succeeded and left nothing behind; returns its output."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        subprocess.run([sys.executable, str(ROOT / "bench" / "netem.py"), "--cleanup"], capture_output=True)
        raise AssertionError(f"netem.py ran past {timeout_s} s\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert_nothing_left(proc.pid, [])
    return stdout, stderr


def alive(pid: int) -> bool:
    """Runs (a zombie, which no parent reaped yet, does not run)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_nothing_left(owner: int, pids: list[int]) -> None:
    """No namespace or link of run ``owner`` (by the names netem.py gives), none of ``pids`` alive."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"rwnetem-{owner}-" not in namespaces, namespaces
    assert f"rwe{owner}b" not in links and f"rwe{owner}o" not in links and f"rwe{owner}i" not in links, links
    assert not [p for p in pids if alive(p)], [p for p in pids if alive(p)]


def wait_running(proc: subprocess.Popen, hosts: int, timeout_s: float = 20, each: int = 2) -> list[int]:
    """The pids in run ``proc``'s namespaces once every one of them runs ``each`` processes (the
    launcher and its rank; a delay line besides)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        names = netem.namespaces(proc.pid)
        pids = [[int(p) for p in netem.out("ip", "netns", "pids", ns).split()] for ns in names]
        if len(names) == hosts and all(len(p) >= each for p in pids):
            return [p for ps in pids for p in ps]
        time.sleep(0.1)
    raise AssertionError(f"the job had not started in every namespace after {timeout_s} s")


SLEEPER = "import runtime, asyncio, time\nasyncio.run(runtime.init())\ntime.sleep(120)\n"


@needs_netns
@pytest.mark.timeout(180)
def test_two_namespaces_behind_shaped_links(tmp_path):
    out_json = tmp_path / "n.json"
    stdout, _ = finish(start("-n", "2", "--rate", "1gbit", "--max-time-s", "120", "--", "--ops", "broadcast,all_reduce",
                             "--sizes", "4,1M", "--iters", "2", "--plot", "", "--json", str(out_json)), 170)
    assert "2 ranks (netem 2 namespaces, 1gbit)" in stdout, stdout[-3000:]
    report = json.loads(out_json.read_text())
    rows = {(r["op"], r["bytes"]): r for r in report["rows"]}
    # the emulated hosts are namespaces of one machine: one clock (boot_id), so both timings are there
    assert report["meta"]["last"].startswith("recorded"), report["meta"]["last"]
    assert all(0 < r["time_last_us"] <= r["time_call_us"] for r in rows.values()), rows
    assert rows[("broadcast", 1 << 20)]["algorithm"] == "chain"  # the table's choice across hosts
    assert rows[("broadcast", 4)]["algorithm"] == "flat"
    # 1 MiB over a 1 Gbit/s link (125 MB/s) takes at least 6.3 ms even when tc's 256 KB burst lets
    # its first quarter through at once (256 KiB alone could pass in the burst: it took 1.43 ms in
    # one CI run); loopback takes well under 2 ms
    assert rows[("broadcast", 1 << 20)]["time_us"] > 4000, rows[("broadcast", 1 << 20)]


@needs_netns
@pytest.mark.timeout(180)
def test_two_ranks_per_namespace(tmp_path):
    """--per-node 2 --shm on: 4 ranks on 2 emulated hosts. The default all_reduce (the hierarchical
    algorithm from 64 KiB across hosts, named so; the TCP table's choice below), all_gather and
    reduce_scatter (hierarchical from 1 MiB) give the bench's closed-form answers."""
    out_json = tmp_path / "n.json"
    stdout, _ = finish(start("-n", "2", "--per-node", "2", "--shm", "on", "--rate", "1gbit", "--max-time-s", "120",
                             "--", "--ops", "all_reduce,all_gather,reduce_scatter", "--sizes", "4,1M", "--iters", "2",
                             "--plot", "", "--json", str(out_json)), 170)
    assert "4 ranks (netem 2 namespaces x 2 ranks, 1gbit)" in stdout, stdout[-3000:]
    rows = {(r["op"], r["bytes"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert rows[("all_reduce", 1 << 20)]["algorithm"] == "hierarchical", rows  # checked against the closed form
    assert rows[("all_reduce", 4)]["algorithm"] == "recursive_doubling", rows
    for op in ("all_gather", "reduce_scatter"):  # a block crosses into each host once
        assert rows[(op, 1 << 20)]["algorithm"] == "hierarchical", rows


def peers_missing() -> str | None:
    if WHY_NOT:
        return WHY_NOT
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the Gloo peer)"
    if shutil.which("mpirun") is None:
        return "mpirun is not installed: `make sysdeps` installs Open MPI"
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError as e:
        return f"mpi4py does not load ({e}): pip install mpi4py, with Open MPI installed"
    return None


PEERS_MISSING = peers_missing()


@pytest.mark.skipif(PEERS_MISSING is not None, reason=PEERS_MISSING or "")
@pytest.mark.timeout(60)
def test_every_row_has_its_peers_between_hosts(tmp_path):
    """--compare gloo,mpi on 2 emulated hosts: one mpirun in the first namespace starts the other's
    ranks through netem's agent; Gloo's store and pairs and MPI's tcp btl cross the link, and each
    row holds both peers' times (each checked against the closed form before it is timed)."""
    out_json = tmp_path / "n.json"
    stdout, _ = finish(start("-n", "2", "--max-time-s", "45", "--", "--compare", "gloo,mpi", "--mpi-btl", "tcp",
                             "--ops", "all_reduce,broadcast", "--sizes", "4,64K", "--iters", "2", "--warmup", "1",
                             "--warmup-rounds", "5", "--plot", "", "--json", str(out_json)), 55)
    report = json.loads(out_json.read_text())
    assert report["meta"]["launch"] == "netem 2 namespaces, 1gbit, mpirun (btl self,tcp)", report["meta"]
    assert report["meta"]["host"] == "rw-netem-0"
    rows = report["rows"]
    assert len(rows) == 4 and all(r["gloo"]["time_us"] > 0 and r["mpi-tcp"]["time_us"] > 0 for r in rows), rows
    assert all(0 < r[p]["time_last_us"] <= r[p]["time_call_us"] for r in rows for p in ("gloo", "mpi-tcp")), rows


@needs_netns
@pytest.mark.timeout(60)
def test_the_trainer_on_two_emulated_hosts(tmp_path):
    """Any launcher job: `-m trainer`, one rank on each of 2 hosts behind links of different rates."""
    out_json = tmp_path / "history.json"
    stdout, _ = finish(start("-n", "2", "--rate", "100mbit,1gbit", "--max-time-s", "45", "--", "-m", "trainer",
                             "--data", "synthetic", "--size", "256", "--width", "16", "--depth", "1", "--epochs", "1",
                             "--quiet", "--json", str(out_json)), 55)
    assert "ddp on 2 rank(s)" in stdout, stdout[-3000:]
    history = json.loads(out_json.read_text())["history"]
    assert history, history


@needs_netns
@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig,delayed", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                         pytest.param(signal.SIGTERM, True, marks=needs_queue)])
def test_a_signal_mid_run_leaves_no_namespace_link_or_process(tmp_path, sig, delayed):
    """Delayed: the delay lines (processes in the namespaces, counted among the pids) stop too."""
    job = tmp_path / "sleeper.py"
    job.write_text(SLEEPER)
    proc = start("-n", "2", "--max-time-s", "60", *(("--delay", "1ms", "--delay-by", "nfqueue") if delayed else ()),
                 "--", str(job))
    try:
        pids = wait_running(proc, 2, each=3 if delayed else 2)
        proc.send_signal(sig)
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, proc.returncode
    assert_nothing_left(proc.pid, pids)


@needs_netns
@pytest.mark.timeout(30)
def test_cleanup_removes_what_a_killed_run_left_and_nothing_else(tmp_path):
    job = tmp_path / "sleeper.py"
    job.write_text(SLEEPER)
    other = f"rwnetemx-{os.getpid()}"  # near the pattern, not in it: not ours to delete
    subprocess.run(["ip", "netns", "add", other], check=True, capture_output=True)
    delayed = NO_QUEUE is None  # then the delay lines outlive netem.py too, and --cleanup stops them
    proc = start("-n", "2", "--max-time-s", "60", *(("--delay", "1ms", "--delay-by", "nfqueue") if delayed else ()),
                 "--", str(job))
    try:
        pids = wait_running(proc, 2, each=3 if delayed else 2)
        proc.kill()  # SIGKILL: nothing of netem.py runs; the job does, and holds its output pipes
        proc.wait(timeout=10)
        assert len(netem.namespaces(proc.pid)) == 2
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "netem.py"), "--cleanup"],
                              capture_output=True, text=True, timeout=20)
        assert done.returncode == 0, done.stderr
        assert f"removed what run {proc.pid} left" in done.stdout, done.stdout
        assert_nothing_left(proc.pid, pids)
        assert other in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        proc.communicate(timeout=10)
    finally:
        subprocess.run(["ip", "netns", "del", other], capture_output=True)
        if proc.poll() is None or netem.namespaces(proc.pid):
            proc.kill()
            netem.teardown(proc.pid)


@needs_netns
@pytest.mark.timeout(40)
def test_a_job_past_its_time_limit_is_stopped_and_removed(tmp_path):
    job = tmp_path / "sleeper.py"
    job.write_text(SLEEPER)
    proc = start("-n", "2", "--max-time-s", "5", "--", str(job))
    try:
        pids = wait_running(proc, 2)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 124, proc.returncode  # the launchers' exit for --max-time-s
    assert_nothing_left(proc.pid, pids)


@needs_queue
@pytest.mark.timeout(60)
def test_the_delay_line_is_a_floor_under_a_round_trip(tmp_path):
    """--delay 2ms by the delay line in user space: 2 ms on each end of each link, so a hop
    between hosts takes 4 ms and a 2-rank barrier (one exchange, each waits for the other's
    message) at least that; undelayed it takes well under 1 ms across the same links."""
    out_json = tmp_path / "n.json"
    stdout, _ = finish(start("-n", "2", "--delay", "2ms", "--delay-by", "nfqueue", "--max-time-s", "45", "--",
                             "--ops", "barrier", "--sizes", "4", "--iters", "3", "--plot", "", "--json", str(out_json)),
                       55)
    assert "2 ranks (netem 2 namespaces, 1gbit, +2ms by nfqueue)" in stdout, stdout[-3000:]
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["time_us"] > 0.9 * 4000, row


def test_the_delay_lines_netlink_messages_match_the_kernels_layout():
    """Against the layouts of linux/netfilter/nfnetlink_queue.h: nlmsghdr (native order),
    nfgenmsg (queue number big-endian), attributes padded to 4 bytes, big-endian payloads."""
    bind, params = delayline.config_messages(7, maxlen=1000)
    length, kind, flags, seq, port = struct.unpack_from("=IHHII", bind)
    assert (length, kind, flags, seq, port) == (len(bind), (3 << 8) | 2, 1 | 4, 1, 0)
    assert bind[16:20] == bytes([0, 0, 0, 7])  # AF_UNSPEC, NFNETLINK_V0, queue 7
    assert bind[20:] == struct.pack("=HH", 8, 1) + bytes([1, 0, 0, 0])  # NFQA_CFG_CMD: BIND, pf 0
    attrs = params[20:]
    assert attrs[:12] == struct.pack("=HH", 9, 2) + struct.pack("!IB", 0, 1) + b"\0\0\0"  # copy range 0, COPY_META
    assert attrs[12:] == b"".join(struct.pack("=HH", 8, t) + struct.pack("!I", v) for t, v in ((3, 1000), (4, 4), (5, 4)))
    drop = delayline.verdict(7, 0x01020304, False)
    assert struct.unpack_from("=HH", drop, 4) == ((3 << 8) | 1, 1)
    assert drop[20:] == struct.pack("=HH", 12, 2) + struct.pack("!II", 0, 0x01020304)
    batch = delayline.verdict(7, 9, True, batch=True)
    assert struct.unpack_from("=H", batch, 4)[0] == (3 << 8) | 3 and batch[-8:] == struct.pack("!II", 1, 9)


def test_the_delay_line_reads_the_packet_ids_and_acks_of_one_recv():
    def packet(pid: int) -> bytes:  # NFQA_PACKET_HDR, then an attribute it skips (a 5-byte NFQA_PAYLOAD, padded)
        body = struct.pack("!BBH", 2, 0, 0) + struct.pack("=HH", 11, 1) + struct.pack("!IHB", pid, 0x0800, 1) \
            + b"\0" + struct.pack("=HH", 9, 10) + b"abcde" + b"\0\0\0"
        return struct.pack("=IHHII", 16 + len(body), (3 << 8), 0, 0, 0) + body
    ack = struct.pack("=IHHII", 36, 2, 0, 5, 0) + struct.pack("=i", -1) + bytes(16)
    ids, acks = delayline.parse(packet(41) + ack + packet(42))
    assert ids == [41, 42] and acks == [(5, 1)]
    assert delayline.parse(packet(7)[:-4]) == ([], [])  # a message cut short is not read past its end


@pytest.mark.parametrize("text,seconds", [("1ms", 1e-3), ("100us", 1e-4), ("0.5s", 0.5), ("250", 2.5e-4),
                                          ("2msec", 2e-3)])
def test_the_delay_line_reads_tcs_time_spellings(text, seconds):
    assert delayline.seconds(text) == pytest.approx(seconds)


def test_the_delay_line_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="not a time"):
        delayline.seconds("1 hour")
    with pytest.raises(ValueError, match="within 0..100%"):
        delayline.fraction("120%")
    assert delayline.fraction("0.1%") == pytest.approx(0.001) and delayline.fraction(None) == 0.0
