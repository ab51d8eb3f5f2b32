"""Shared test set-up: the repository root on sys.path (for tests.conformance), the multi-rank
fixture ``ranks`` from runtime.testing, and the ``gpu`` marker: the GPU case modules
(``tests/*/gpu_*_cases.py``) are collected where a GPU is usable (tests/cudasim.py), and run under
the simulator in CI through tests/*/test_*_cuda.py either way (marked ``cudasim``: this pytest run's
case modules run together, in one interpreter).

The ``serial`` and ``alone`` markers (:data:`SERIAL`, :data:`ALONE`): `make test` runs the tests
marked neither on both cores (pytest-xdist: ``-n 2 --dist loadfile -m "not serial"``), then the
serial ones two at a time, never beside the rest (``-n 2 -m "serial and not alone"``), then the
``alone`` ones one at a time (``-m alone``); a plain ``pytest`` runs everything in one process."""

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests import cudasim  # noqa: E402 - after the root is on sys.path

pytest_plugins = ["runtime.testing"]

# The built-in tables, whatever rules `python -m collectives.tune` left in this user's cache (the
# tuner's own tests turn them back on); ranks that tests start inherit it.
os.environ["RINGWEAVE_TUNE"] = "0"
# No warm-up at init: most test processes make a call or two, and loading every kernel in each of
# them costs the suite CPU (tests/collectives/test_coll_first_call.py turns it back on).
os.environ["RINGWEAVE_WARMUP"] = "0"
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":  # simulated threads get the GIL sooner (tests/cudasim.py)
    sys.setswitchinterval(cudasim.SWITCH_INTERVAL_S)


# The tests that run apart from the rest (marked ``serial`` here, by path, so that no test file need
# say so; a test may also carry ``@pytest.mark.serial`` itself): they launch jobs with deadlines
# (SLURM and mpirun jobs, elastic recovery, the launcher's own tests, the benchmarks' smoke runs), or
# are one of :data:`ALONE` (serial too). Two of them may run at once: each shares nothing fixed with
# another (ports from the kernel, /dev/shm names with the job's port and a token, pytest's tmp_path;
# the scheduler's files share one private SLURM and run on one worker, :data:`GROUPS`), and its
# verdict holds with one other test beside it. An entry is a folder ("tests/faults/"), a file, or a
# file's test ("FILE::NAME", every parametrization of it).
SERIAL = (
    "tests/faults/", "tests/elastic/", "tests/scheduler/", "tests/security/", "tests/launch/",
    "tests/bench/test_bench_smoke.py", "tests/bench/test_compress_e2e.py", "tests/bench/test_machine.py",
    "tests/store/test_store_many_clients.py",
    "tests/collectives/test_coll_blocking.py::test_plain_script_through_launcher",
)

# The serial tests that run with nothing beside them (marked ``alone`` and ``serial``; a test may carry
# ``@pytest.mark.alone`` itself): their verdict depends on wall-clock time. Each asserts a bound on an
# elapsed time (a few seconds, or a lower bound too), detects a fault within a tight deadline (a
# stalled, stopped or killed peer, a named timeout of seconds, a handshake deadline, an idle tool),
# takes a figure (first call, loop turns, a tuning run), or holds something of the machine's own
# (network namespaces and iptables rules, another user watching /dev/shm or the job's ports). When
# unsure, a test is alone: it costs its own time, a flaky one a rerun of the suite.
ALONE = (
    "tests/faults/test_fault_abort.py", "tests/faults/test_fault_kill.py", "tests/faults/test_fault_mismatch.py",
    "tests/faults/test_fault_stall.py", "tests/faults/test_fault_stopped_mid_transfer.py",
    "tests/faults/test_fault_store_host.py", "tests/faults/test_fault_user_raise.py",
    "tests/elastic/test_elastic_faults.py::"
    "test_a_member_lost_during_the_recovery_before_it_connects_then_one_stopped_past_the_timeout",
    "tests/soak/", "tests/multinode/", "tests/bench/test_netem_smoke.py", "tests/collectives/test_tune_netem.py",
    "tests/bench/test_machine.py::test_a_job_past_its_limit_is_stopped_with_its_process_group",
    "tests/security/test_handshake_timeout.py", "tests/security/test_listeners.py",
    "tests/security/test_security_fuzz.py", "tests/security/test_security_job.py",
    "tests/security/test_tool_idle.py", "tests/security/test_jobsecret.py", "tests/security/test_shm_names.py",
    "tests/security/test_takeover.py", "tests/security/test_init_and_launcher.py",
    "tests/launch/test_watch.py", "tests/launch/test_processes.py", "tests/launch/test_launcher_killed.py",
    "tests/launch/test_first_failure.py::test_ten_jobs_whose_victims_exit_first_name_the_raiser",
    "tests/shm/test_shm_processes.py", "tests/shm/test_shm_domains.py", "tests/shm/test_shm_unit.py",
    "tests/shm/test_shm_waits.py", "tests/shm/test_shm_atomics.py", "tests/shm/test_shm_fastpath_inline.py",
    "tests/runtime/test_stalled_peer.py", "tests/runtime/test_peers.py", "tests/runtime/test_membership.py",
    "tests/runtime/test_recv_now.py", "tests/runtime/test_dial.py",
    "tests/store/test_store_tcp.py", "tests/store/test_store_blocking.py",
    "tests/collectives/test_coll_failures.py", "tests/collectives/test_coll_late_rank.py",
    "tests/collectives/test_coll_monitored_barrier.py", "tests/collectives/test_commit.py",
    "tests/collectives/test_coll_first_call.py", "tests/collectives/test_tune_command.py",
    "tests/parallel/test_mesh_faults.py",
    "tests/parallel/test_mesh_launcher.py::test_a_rank_killed_in_a_tp2_pp2_step_fails_every_rank_naming_it",
    "tests/loop/test_ticker.py",
    "tests/torch_backend/test_torch_failures.py",
)

# Files that share a fixture of the whole run go on one xdist worker, as one file: the scheduler's tests
# start one private SLURM and make one reference run.
GROUPS = {"tests/scheduler/": "the scheduler's files"}


def _path(item) -> str:
    """The test's file, relative to the repository root ("tests/faults/test_fault_stall.py")."""
    path = Path(str(item.path)).resolve()
    return path.relative_to(_ROOT).as_posix() if path.is_relative_to(_ROOT) else path.as_posix()


def _listed(item, entries) -> bool:
    """Whether ``item`` is one of ``entries`` (folders, files, "FILE::NAME")."""
    path = _path(item)
    test = f"{path}::{getattr(item, 'originalname', item.name)}"
    return any(path.startswith(entry) if entry.endswith("/") else entry in (path, test) for entry in entries)


def is_alone(item) -> bool:
    """Whether ``item`` is one of :data:`ALONE` or marked ``alone`` in its file."""
    return item.get_closest_marker("alone") is not None or _listed(item, ALONE)


def is_serial(item) -> bool:
    """Whether ``item`` is one of :data:`SERIAL`, marked ``serial`` in its file, or alone."""
    return item.get_closest_marker("serial") is not None or _listed(item, SERIAL) or is_alone(item)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: numba.cuda cases (tests/*/gpu_*_cases.py): on a real GPU with `pytest -m gpu`, "
        "collected where numba.cuda finds a device; under the simulator in CI (tests/cudasim.py)")
    config.addinivalue_line(
        "markers", "cudasim(cases): the test runs the case module `cases` under the simulator; the session's "
        "case modules run in one interpreter (tests/cudasim.py)")
    config.addinivalue_line(
        "markers", "serial: runs apart from the rest, beside at most one other serial test (SERIAL in "
        "tests/conftest.py): `make test` runs these after the rest, with -n 2 -m \"serial and not alone\"")
    config.addinivalue_line(
        "markers", "alone: runs with no other test beside it (ALONE in tests/conftest.py; serial too): "
        "`make test` runs these last, one at a time, with -m alone")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks the tests of :data:`SERIAL` ``serial`` and those of :data:`ALONE` ``alone`` and ``serial``."""
    for item in items:
        if is_alone(item):
            item.add_marker(pytest.mark.alone)
        if is_serial(item):
            item.add_marker(pytest.mark.serial)


def simulated_files() -> set[str]:
    """The test files that run case modules under the simulator (a ``cudasim`` marker in them)."""
    return {p.relative_to(_ROOT).as_posix() for p in Path(_ROOT, "tests").rglob("test_*.py")
            if "mark.cudasim" in p.read_text(errors="replace")}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``--dist loadfile`` (each file's tests on one worker: its module fixtures
    are made once), with the files of :func:`simulated_files` as one file, so that the simulator's
    one run of every case module (tests/cudasim.py) happens on one worker, once, and the files of a
    folder of :data:`GROUPS` as one file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    simulated = simulated_files()

    class FilesScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            if path in simulated:
                return "the simulator's wrappers"
            return next((name for folder, name in GROUPS.items() if path.startswith(folder)), path)

    return FilesScheduling(config, log)


def pytest_collect_file(file_path, parent):
    """The GPU case modules, where a GPU is usable; a module named on the command line is
    collected by pytest itself."""
    if cudasim.is_case_module(file_path) and not parent.session.isinitpath(file_path) and cudasim.gpu_usable():
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_finish(session):
    """The case modules that the selected tests will run under the simulator, for one run of all."""
    for item in session.items:
        marker = item.get_closest_marker("cudasim")
        if marker is not None:
            cudasim.want(marker.args[0])
