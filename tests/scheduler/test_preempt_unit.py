"""trainer/preempt.py in one process: the scope's handlers, what the hook does with a noted
signal, the exit codes, and the settings that choose the signals."""

import asyncio
import os
import signal

import pytest

from runtime import env
from runtime.errors import SettingError
from trainer import preempt


async def test_a_noted_signal_saves_and_raises_with_128_plus_the_signal(monkeypatch):
    monkeypatch.delenv(env.PREEMPT_EXIT_CODE.name, raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    saved = []

    async def save():
        saved.append(True)

    with preempt.Preemption(("SIGTERM", "SIGUSR1")) as scope:
        assert preempt.active() is scope and signal.getsignal(signal.SIGUSR1) == scope._note
        await preempt.at_step_boundary(None, save)  # nothing noted: nothing happens
        assert saved == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next bytecode
        with pytest.raises(preempt.Preempted) as caught:
            await preempt.at_step_boundary(None, save)
    assert saved == [True]
    assert (caught.value.signum, caught.value.exit_code, caught.value.step_saved) == (signal.SIGUSR1, 138, True)
    assert "stopped by SIGUSR1" in str(caught.value)
    assert preempt.active() is None and signal.getsignal(signal.SIGUSR1) == before  # restored


async def test_outside_a_scope_or_disabled_the_hook_does_nothing_and_no_handler_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    await preempt.at_step_boundary(None, None)
    with preempt.Preemption(enabled=False):
        assert preempt.active() is None and signal.getsignal(signal.SIGTERM) == before
    with preempt.Preemption(signals=()):
        assert preempt.active() is None


async def test_scopes_do_not_nest():
    with preempt.Preemption(("SIGUSR2",)):
        with pytest.raises(RuntimeError, match="already entered"):
            with preempt.Preemption(("SIGUSR2",)):
                pass


def test_the_signals_and_the_exit_code_settings(monkeypatch):
    signals, code = env.PREEMPT_SIGNALS, env.PREEMPT_EXIT_CODE
    monkeypatch.delenv(signals.name, raising=False)
    assert signals.get() == ("SIGTERM", "SIGUSR1")
    monkeypatch.setenv(signals.name, "usr2, SIGTERM,10")
    assert signals.get() == ("SIGUSR2", "SIGTERM", "SIGUSR1")
    monkeypatch.setenv(signals.name, "none")
    assert signals.get() == ()
    for bad in ("USR3", "KILL"):
        monkeypatch.setenv(signals.name, bad)
        with pytest.raises(SettingError, match=signals.name):
            signals.get()
    monkeypatch.delenv(code.name, raising=False)
    assert env.preempt_exit_code(signal.SIGTERM) == 143
    monkeypatch.setenv(code.name, "75")
    assert env.preempt_exit_code(signal.SIGTERM) == 75
    for bad in ("0", "256", "x"):
        monkeypatch.setenv(code.name, bad)
        with pytest.raises(SettingError, match=code.name):
            env.preempt_exit_code(signal.SIGTERM)


async def test_ranks_with_different_step_times_check_at_the_same_boundaries_and_stop_together(ranks):
    """The agreement's cadence (check_s / the slowest mean step) is decided from reduced numbers,
    so it is the same on every rank; a signal noted on one rank stops all after the same step."""
    async def body(world):
        scope = preempt.Preemption(("SIGUSR2",), check_s=0.03)  # one per rank: ranks share this process
        checks, stopped_at = [], None
        for step in range(60):
            await asyncio.sleep(0.001 * (1 + 3 * world.rank))  # rank r's steps take (1 + 3r) ms
            if world.rank == 1 and step == 25:
                scope.received = signal.SIGUSR2  # as the handler would
            countdown = scope._countdown
            signum = await scope.agreed(world)
            if countdown == 0:
                checks.append(step)
            if signum:
                stopped_at = (step, signum)
                break
        return checks, stopped_at

    results = await ranks(4, body)
    assert all(r == results[0] for r in results), results
    checks, (step, signum) = results[0]
    assert signum == signal.SIGUSR2 and 25 <= step and step == checks[-1]
    assert 3 <= len(checks) < 30  # some boundaries were skipped, and ranks still agreed
