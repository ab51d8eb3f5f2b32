"""The launcher's pure decisions, without processes: configuration, the
environment of a rank, exit codes, restarts, reports, line splitting."""

from __future__ import annotations

import signal

import pytest

from runtime import launch_config, launch_outcome
from runtime.launch_config import LaunchConfig
from runtime.launch_outcome import Action, Ending, Outcome, RankExit
from runtime.procs import LineSplitter

pytestmark = pytest.mark.timeout(10)


def cfg(**kw) -> LaunchConfig:
    kw.setdefault("nproc", 4)
    kw.setdefault("target", "train.py")
    return LaunchConfig(**kw)


# -- parse_args / check_config -------------------------------------------------


def test_parse_script_and_its_args_go_to_the_ranks():
    c = launch_config.parse_args(["-n", "3", "train.py", "-n", "9", "--lr", "0.1"])
    assert (c.nproc, c.target, c.args, c.module) == (3, "train.py", ("-n", "9", "--lr", "0.1"), False)
    assert launch_config.rank_argv(c, python="py") == ["py", "train.py", "-n", "9", "--lr", "0.1"]


def test_parse_module():
    c = launch_config.parse_args(["-n", "2", "--max-restarts", "2", "-m", "trainer", "--epochs", "3"])
    assert (c.module, c.target, c.args, c.max_restarts) == (True, "trainer", ("--epochs", "3"), 2)
    assert launch_config.rank_argv(c, python="py") == ["py", "-m", "trainer", "--epochs", "3"]


def test_parse_multi_node():
    c = launch_config.parse_args(["-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                           "--master-port", "29500", "--job-id", "exp", "x.py"])
    assert (c.world_size, c.node_rank, c.hosts_store, c.advertised_addr) == (4, 1, False, "h")


@pytest.mark.parametrize("kw, words", [
    (dict(nproc=0), "-n"),
    (dict(nnodes=2, node_rank=2, master_addr="h", master_port=1), "--node-rank"),
    (dict(nnodes=2, master_port=29500), "--master-addr"),
    (dict(nnodes=2, master_addr="h"), "--master-port"),
    (dict(nnodes=2, master_addr="h", master_port=0), "--master-port"),
    (dict(master_port=70000), "--master-port"),
    (dict(max_restarts=-1), "--max-restarts"),
    (dict(grace_s=-1.0), "--grace-s"),
    (dict(max_time_s=0.0), "--max-time-s"),
])
def test_check_config_names_the_bad_option(kw, words):
    with pytest.raises(ValueError, match=words):
        launch_config.check_config(cfg(**kw))


def test_missing_n_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        launch_config.parse_args(["train.py"])
    assert e.value.code == 2


# -- store address and secret ------------------------------------------------------


def test_single_node_store_on_loopback():
    assert launch_config.store_listen_host(cfg()) == "127.0.0.1"
    assert cfg().advertised_addr == "127.0.0.1"


def test_multi_node_store_listens_on_every_interface_unless_loopback():
    assert launch_config.store_listen_host(cfg(nnodes=2, master_addr="10.0.0.1", master_port=5)) == "0.0.0.0"
    assert launch_config.store_listen_host(cfg(nnodes=2, master_addr="fd00::1", master_port=5)) == "::"
    assert launch_config.store_listen_host(cfg(nnodes=2, master_addr="127.0.0.1", master_port=5)) == "127.0.0.1"


def test_secret_from_the_environment_wins():
    assert launch_config.choose_secret(cfg(), "s3", make=lambda: "fresh") == "s3"
    multi = cfg(nnodes=2, master_addr="10.0.0.1", master_port=5)
    assert launch_config.choose_secret(multi, "s3", make=lambda: "fresh") == "s3"


def test_single_node_makes_a_fresh_secret():
    assert launch_config.choose_secret(cfg(), None, make=lambda: "fresh") == "fresh"
    assert len(launch_config.choose_secret(cfg(), "")) == 64  # empty counts as unset


def test_multi_node_beyond_loopback_refuses_without_a_secret():
    multi = cfg(nnodes=2, master_addr="10.0.0.1", master_port=5)
    with pytest.raises(ValueError, match="RINGWEAVE_SECRET"):
        launch_config.choose_secret(multi, None)


def test_multi_node_on_loopback_leaves_the_secret_to_the_private_file():
    multi = cfg(nnodes=2, master_addr="127.0.0.1", master_port=5)
    assert launch_config.choose_secret(multi, None) is None  # run_job derives it (runtime/jobsecret.py)


def test_job_id():
    assert launch_config.choose_job_id(cfg(job_id="exp7")) == "exp7"
    assert launch_config.choose_job_id(cfg(), make=lambda: "ab") == "job-ab"
    assert launch_config.choose_job_id(cfg(nnodes=2, master_addr="h", master_port=5)) == "h:5"


# -- rank_env ----------------------------------------------------------------------


def test_rank_env_names_and_values():
    c = cfg(nproc=2, nnodes=3, node_rank=1, master_addr="10.0.0.1", master_port=29500, timeout_s=30)
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "7", "RINGWEAVE_SECRET": "old"}
    env = launch_config.rank_env(base, c, 1, master_port=29500, secret="s", job="j", restart=2, cores=8)
    assert env["PATH"] == "/bin"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "NODE_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "NODE_RANK": "1", "GROUP_WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert {k: env[k] for k in ("RINGWEAVE_SECRET", "RINGWEAVE_JOB", "RINGWEAVE_STORE_HOSTED",
                                "RINGWEAVE_RESTART", "RINGWEAVE_TIMEOUT_S", "PYTHONUNBUFFERED")} == {
        "RINGWEAVE_SECRET": "s", "RINGWEAVE_JOB": "j", "RINGWEAVE_STORE_HOSTED": "1",
        "RINGWEAVE_RESTART": "2", "RINGWEAVE_TIMEOUT_S": "30", "PYTHONUNBUFFERED": "1"}
    # thread variables: the user's value stays, the others get cores // ranks on the node
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["NUMBA_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4"
    assert base == {"PATH": "/bin", "OMP_NUM_THREADS": "7", "RINGWEAVE_SECRET": "old"}  # not modified
    assert "RINGWEAVE_LAUNCHER_PID" not in env
    assert launch_config.rank_env(base, c, 1, master_port=29500, secret="s", job="j", restart=2, cores=8,
                                  launcher_pid=4242)["RINGWEAVE_LAUNCHER_PID"] == "4242"


def test_rank_env_without_secret_drops_the_inherited_one():
    env = launch_config.rank_env({"RINGWEAVE_SECRET": "old"}, cfg(), 0, master_port=1, secret=None,
                                 job="j", restart=0, cores=1)
    assert "RINGWEAVE_SECRET" not in env
    assert "RINGWEAVE_TIMEOUT_S" not in env


def test_help_names_every_variable_a_rank_is_given():
    """``--help`` is where a user reads a rank's environment: every variable rank_env sets is there."""
    c = cfg(timeout_s=30)
    given = launch_config.rank_env({}, c, 0, master_port=1, secret="s", job="j", restart=0, cores=4,
                                   launcher_pid=1)
    help_text = launch_config.build_parser().format_help()
    missing = [name for name in given if name not in help_text]
    assert not missing, f"set by rank_env, not named in --help: {missing}"
    assert len(given) >= 17  # torchrun's names, ours, the thread variables


@pytest.mark.parametrize("cores, ranks, want", [(8, 4, 2), (2, 4, 1), (7, 2, 3), (1, 1, 1)])
def test_thread_count(cores, ranks, want):
    assert launch_config.thread_count(cores, ranks) == want


def test_attempt_prefix_differs_per_restart():
    assert launch_config.attempt_prefix(0) == "restart/0"
    assert launch_config.attempt_prefix(0) != launch_config.attempt_prefix(1)


# -- exit codes and decisions ----------------------------------------------------------


@pytest.mark.parametrize("returncode, code, text", [
    (0, 0, "exit code 0"),
    (3, 3, "exit code 3"),
    (-signal.SIGKILL, 137, "signal SIGKILL (exit code 137)"),
    (-signal.SIGTERM, 143, "signal SIGTERM (exit code 143)"),
    (-signal.SIGSEGV, 139, "signal SIGSEGV (exit code 139)"),
])
def test_exit_code_and_description(returncode, code, text):
    assert launch_outcome.exit_code_of(returncode) == code
    assert launch_outcome.describe_exit(returncode) == text


def test_unknown_signal_number_still_described():
    assert launch_outcome.signal_name(200) == "signal 200"


def test_first_failure_is_the_earliest_then_lowest_rank():
    exits = [RankExit(0, 0, 1.0), RankExit(3, 1, 2.0), RankExit(2, -9, 1.5), RankExit(1, 4, 1.5)]
    assert launch_outcome.first_failure(exits) == RankExit(1, 4, 1.5)
    assert launch_outcome.first_failure([RankExit(0, 0, 1.0)]) is None
    assert launch_outcome.first_failure([]) is None


def failed(rank=2, rc=3) -> Outcome:
    return Outcome(Ending.FAILED, failure=RankExit(rank, rc, 0.0))


def test_next_step_succeeded():
    assert launch_outcome.next_step(Outcome(Ending.SUCCEEDED), 0, 3) == (Action.EXIT, 0)


def test_next_step_failure_without_restarts_exits_with_its_code():
    assert launch_outcome.next_step(failed(rc=3), 0, 0) == (Action.EXIT, 3)
    assert launch_outcome.next_step(failed(rc=-signal.SIGKILL), 0, 0) == (Action.EXIT, 137)


def test_next_step_restarts_until_the_budget_is_spent():
    assert launch_outcome.next_step(failed(), 0, 2) == (Action.RESTART, 0)
    assert launch_outcome.next_step(failed(), 1, 2) == (Action.RESTART, 0)
    assert launch_outcome.next_step(failed(rc=5), 2, 2) == (Action.EXIT, 5)


def test_next_step_signal_to_the_launcher_never_restarts():
    assert launch_outcome.next_step(Outcome(Ending.INTERRUPTED, signum=signal.SIGINT), 0, 5) == (Action.EXIT, 130)
    assert launch_outcome.next_step(Outcome(Ending.INTERRUPTED, signum=signal.SIGTERM), 0, 5) == (Action.EXIT, 143)


def test_next_step_timeout_never_restarts():
    assert launch_outcome.next_step(Outcome(Ending.TIMED_OUT), 0, 5) == (Action.EXIT, 124)


def test_failure_report_names_rank_signal_and_last_lines():
    lines = launch_outcome.failure_report(cfg(), RankExit(2, -signal.SIGKILL, 0.0), ["a", "b"])
    assert lines[0] == "rank 2 failed first: signal SIGKILL (exit code 137)"
    assert lines[1:] == ["last 2 lines of rank 2:", "  | a", "  | b"]


def test_failure_report_multi_node_names_the_node():
    c = cfg(nproc=2, nnodes=2, node_rank=1, master_addr="h", master_port=5)
    lines = launch_outcome.failure_report(c, RankExit(3, 1, 0.0), [])
    assert lines == ["rank 3 (node 1, local rank 1) failed first: exit code 1", "rank 3 wrote no output"]


def test_restart_message():
    assert launch_outcome.restart_message(failed(rc=3), 0, 2) == \
        "restarting the job (1 of 2) after rank 2 failed with exit code 3"


# -- LineSplitter --------------------------------------------------------------------------


def test_splitter_joins_lines_across_chunks():
    s = LineSplitter()
    assert s.feed(b"ab") == []
    assert s.feed(b"c\nde\n\nf") == [b"abc", b"de", b""]
    assert s.feed(b"g") == []
    assert s.flush() == [b"fg"]
    assert s.flush() == []


def test_splitter_cuts_a_line_that_never_ends():
    s = LineSplitter(max_line_nbytes=4)
    assert s.feed(b"0123456789") == [b"0123", b"4567"]
    assert s.feed(b"\n") == [b"89"]


def test_stop_plan():
    assert launch_outcome.stop_plan(cfg(), None) == (signal.SIGTERM, None)
    assert launch_outcome.stop_plan(cfg(), Outcome(Ending.SUCCEEDED)) == (signal.SIGTERM, None)
    assert launch_outcome.stop_plan(cfg(), failed(rank=1, rc=-signal.SIGSEGV)) == (
        signal.SIGTERM, "rank 1 failed with signal SIGSEGV (exit code 139); stopping the other ranks")
    assert launch_outcome.stop_plan(cfg(), Outcome(Ending.INTERRUPTED, signum=signal.SIGINT)) == (signal.SIGINT, None)
    assert launch_outcome.stop_plan(cfg(max_time_s=2.0), Outcome(Ending.TIMED_OUT, running=[0, 3])) == (
        signal.SIGTERM, "the job ran past --max-time-s 2; stopping ranks 0 and 3")


# -- one traceback per failure (procs.TracebackFolder, failure_report with an abort) ----------

TRACEBACK = [b"Traceback (most recent call last):", b'  File "job.py", line 3, in <module>',
             b"    comm.all_reduce(x)", b"    ^^^^^^^^^^^^^^^^^^",
             b"runtime.errors.PeerAbortedError: rank 1 aborted the job: ValueError: boom"]


def feed(folder, lines):
    out = [o for line in lines for o in folder.feed(line)]
    return out + folder.flush()


def test_a_traceback_that_echoes_another_ranks_abort_is_one_line():
    from runtime.procs import TracebackFolder
    out = feed(TracebackFolder(lambda: "rank 1's ValueError aborted the job"), [b"before", *TRACEBACK, b"after"])
    assert out == [b"before", TRACEBACK[-1] + b" (traceback of 5 lines not shown: rank 1's ValueError aborted "
                                              b"the job)", b"after"]


def test_chained_tracebacks_fold_into_their_last_line():
    from runtime.procs import TracebackFolder
    chained = [*TRACEBACK[:-1], b"KeyError: 'k'", b"", b"During handling of the above exception, another "
               b"exception occurred:", b"", *TRACEBACK]
    out = feed(TracebackFolder(lambda: "why"), chained)
    assert len(out) == 1 and out[0].startswith(TRACEBACK[-1]) and b"13 lines" in out[0], out


def test_a_traceback_is_written_in_full_unless_folded_and_its_last_line_kept():
    from runtime.procs import TracebackFolder
    folder = TracebackFolder(lambda: None)
    assert feed(folder, TRACEBACK) == TRACEBACK
    assert folder.last_exception == TRACEBACK[-1].decode()


def test_failure_report_names_the_abort_and_does_not_repeat_the_traceback():
    tail = ["Traceback (most recent call last):", '  File "job.py", line 9', "ValueError: boom"]
    aborted = {"rank": 1, "type": "ValueError", "message": "boom"}
    lines = launch_outcome.failure_report(cfg(), RankExit(1, 1, 0.0), tail, aborted, "ValueError: boom")
    assert lines == ["rank 1 failed first: exit code 1, after aborting the job (ValueError: boom)",
                     "its traceback is above, ending: ValueError: boom"]
    lines = launch_outcome.failure_report(cfg(), RankExit(3, 1, 0.0), ["x"], aborted)
    assert lines[0] == "rank 3 failed first: exit code 1; rank 1 had aborted the job (ValueError: boom)"


def test_every_launcher_option_is_described_in_help():
    undescribed = [a.dest for a in launch_config.build_parser()._actions if not (a.help or "").strip()]
    assert not undescribed, f"options without help: {undescribed}"


# -- usage errors ---------------------------------------------------------------------------

USAGE = [b"usage: python -m trainer [-h] [--strategy {ddp,zero1}]", b"                         [--quiet]",
         b"python -m trainer: error: unrecognized arguments: --modle gpt"]


def test_a_usage_block_is_its_error_line_written_once_by_the_ranks_of_an_attempt():
    from runtime.procs import UsageFolder
    written: set[str] = set()
    first, second = UsageFolder(written), UsageFolder(written)
    assert feed(first, [b"before", *USAGE, b"after"]) == [
        b"before", USAGE[-1] + b" (usage: python -m trainer --help)", b"after"]
    assert feed(second, USAGE) == []  # the same error from another rank
    assert first.error == second.error == USAGE[-1].decode()
    assert feed(second, [b"trainer: error: tp=3 does not divide 2"]) == [b"trainer: error: tp=3 does not divide 2"]
    assert feed(first, [b"trainer: error: tp=3 does not divide 2"]) == []


def test_lines_that_only_look_like_usage_pass_as_they_came():
    from runtime.procs import UsageFolder
    folder = UsageFolder()
    lines = [b"usage: 3 GiB of 8", b"  still indented", b"epoch 1 done", b"no error: here", b"x:error: y"]
    assert feed(folder, lines) == lines and folder.error is None
    assert feed(folder, [b"usage: cut short at EOF", b"  [--flag]"]) == [b"usage: cut short at EOF", b"  [--flag]"]


def test_an_exception_line_inside_a_traceback_is_not_a_usage_error():
    from runtime.procs import RankProtocol

    async def written():
        out: list[bytes] = []
        proto = RankProtocol(0, lambda fd, data: out.append(data), 20, usage_errors={"x"})
        lines = [b"Traceback (most recent call last):", b'  File "a.py", line 1', b"ValueError: error: bad", b""]
        proto.pipe_data_received(2, b"\n".join(lines))
        proto.pipe_connection_lost(2, None)
        return b"".join(out), proto.usage_error

    import asyncio
    out, usage = asyncio.run(written())
    assert b"[rank 0] ValueError: error: bad\n" in out and usage is None


def test_a_usage_error_is_never_restarted_and_stops_without_a_notice():
    usage = Outcome(Ending.FAILED, failure=RankExit(0, 2, 0.0), usage_error="prog: error: bad flag")
    assert usage.is_usage_error and not failed(rc=2).is_usage_error  # exit code 2 without an error line
    assert launch_outcome.next_step(usage, 0, 3) == (Action.EXIT, 2)
    assert launch_outcome.stop_plan(cfg(), usage) == (signal.SIGTERM, None)
    assert launch_outcome.usage_report("job-1", usage.failure) == \
        "job job-1 stopped by the usage error above; exiting with 2"
