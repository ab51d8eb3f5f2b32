"""Smoke test of bench/netem.py: 2 ranks in 2 network namespaces behind 1 Gbit/s links run
bench/collectives.py; the table, the JSON and the default algorithm across hosts are checked,
and every namespace and link it made is gone afterwards. It asserts that the harness works,
never a speed. Needs root, ip, tc and unshare; skipped with the reason otherwise."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
@pytest.mark.timeout(180)
def test_two_namespaces_behind_shaped_links(tmp_path):
    out_json = tmp_path / "n.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "netem.py"), "-n", "2", "--rate", "1gbit",
                           "--max-time-s", "120", "--", "--ops", "broadcast,all_reduce",
                           "--sizes", "4,1M", "--iters", "2", "--plot", "", "--json", str(out_json)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "2 ranks (netem 2 namespaces, 1gbit)" in proc.stdout, proc.stdout[-3000:]
    rows = {(r["op"], r["bytes"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert rows[("broadcast", 1 << 20)]["algorithm"] == "chain"  # the table's choice across hosts
    assert rows[("broadcast", 4)]["algorithm"] == "flat"
    # 1 MiB over a 1 Gbit/s link (125 MB/s) takes at least 6.3 ms even when tc's 256 KB burst lets
    # its first quarter through at once (256 KiB alone could pass in the burst: it took 1.43 ms in
    # one CI run); loopback takes well under 2 ms
    assert rows[("broadcast", 1 << 20)]["time_us"] > 4000, rows[("broadcast", 1 << 20)]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    tag = "rwn"  # every namespace the tool makes starts so; its links rwbr/rwi/rwo
    assert tag not in left and "rwbr" not in links and "rwo" not in links, (left, links)


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
@pytest.mark.timeout(180)
def test_two_ranks_per_namespace(tmp_path):
    """--per-node 2 --shm on: 4 ranks on 2 emulated hosts. The default all_reduce (the hierarchical
    algorithm from 64 KiB across hosts, named so; the TCP table's choice below) gives the bench's
    closed-form answers."""
    out_json = tmp_path / "n.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "netem.py"), "-n", "2", "--per-node", "2",
                           "--shm", "on", "--rate", "1gbit", "--max-time-s", "120", "--",
                           "--ops", "all_reduce", "--sizes", "4,1M", "--iters", "2", "--plot", "",
                           "--json", str(out_json)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "4 ranks (netem 2 namespaces x 2 ranks, 1gbit)" in proc.stdout, proc.stdout[-3000:]
    rows = {(r["op"], r["bytes"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert rows[("all_reduce", 1 << 20)]["algorithm"] == "hierarchical", rows  # checked against the closed form
    assert rows[("all_reduce", 4)]["algorithm"] == "recursive_doubling", rows
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "rwn" not in left, left
