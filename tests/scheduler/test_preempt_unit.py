"""trainer/preempt.py in one process: the scope's handlers, what the hook does with a noted
signal, the exit codes, and the settings that choose the signals."""

import os
import signal

import pytest

from runtime import env
from trainer import preempt


async def test_a_noted_signal_saves_and_raises_with_128_plus_the_signal(monkeypatch):
    monkeypatch.delenv(env.PREEMPT_EXIT_CODE_ENV_VAR, raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    saved = []

    async def save():
        saved.append(True)

    async with preempt.Preemption(("SIGTERM", "SIGUSR1")) as scope:
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
    async with preempt.Preemption(enabled=False):
        assert preempt.active() is None and signal.getsignal(signal.SIGTERM) == before
    async with preempt.Preemption(signals=()):
        assert preempt.active() is None


async def test_scopes_do_not_nest():
    async with preempt.Preemption(("SIGUSR2",)):
        with pytest.raises(RuntimeError, match="already entered"):
            async with preempt.Preemption(("SIGUSR2",)):
                pass


def test_the_signals_and_the_exit_code_settings(monkeypatch):
    monkeypatch.delenv(env.PREEMPT_SIGNALS_ENV_VAR, raising=False)
    assert env.preempt_signals() == ("SIGTERM", "SIGUSR1")
    monkeypatch.setenv(env.PREEMPT_SIGNALS_ENV_VAR, "usr2, SIGTERM,10")
    assert env.preempt_signals() == ("SIGUSR2", "SIGTERM", "SIGUSR1")
    monkeypatch.setenv(env.PREEMPT_SIGNALS_ENV_VAR, "none")
    assert env.preempt_signals() == ()
    for bad in ("USR3", "KILL"):
        monkeypatch.setenv(env.PREEMPT_SIGNALS_ENV_VAR, bad)
        with pytest.raises(ValueError, match=env.PREEMPT_SIGNALS_ENV_VAR):
            env.preempt_signals()
    monkeypatch.delenv(env.PREEMPT_EXIT_CODE_ENV_VAR, raising=False)
    assert env.preempt_exit_code(signal.SIGTERM) == 143
    monkeypatch.setenv(env.PREEMPT_EXIT_CODE_ENV_VAR, "75")
    assert env.preempt_exit_code(signal.SIGTERM) == 75
    for bad in ("0", "256", "x"):
        monkeypatch.setenv(env.PREEMPT_EXIT_CODE_ENV_VAR, bad)
        with pytest.raises(ValueError, match=env.PREEMPT_EXIT_CODE_ENV_VAR):
            env.preempt_exit_code(signal.SIGTERM)
    monkeypatch.setenv(env.WATCH_PARENT_ENV_VAR, "no")
    with pytest.raises(ValueError, match=env.WATCH_PARENT_ENV_VAR):
        env.watch_parent()
