"""Reading an environment variable on a hot path.

Some settings are read at every call so that changing them between calls takes effect
(``RINGWEAVE_SHM``, ``RINGWEAVE_ALGO_<COLLECTIVE>``). ``os.environ.get`` costs about 1 us when
the name is absent, the usual case: it encodes the name and raises and catches a KeyError
inside. :func:`get` looks in the dict behind ``os.environ`` (kept by CPython's ``os`` module on
POSIX) with the name encoded once: ~0.1 us. Same answers as ``os.environ.get``: both see what
``os.environ[...] = ...`` (and pytest's monkeypatch) set, neither sees a bare ``os.putenv``.
"""

from __future__ import annotations

import os

_data = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_decode = getattr(os.environ, "decodevalue", None)
_keys: dict[str, object] = {}


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, faster."""
    if _data is None or _encode is None or _decode is None:  # pragma: no cover - not CPython/POSIX
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encode(name)
    value = _data.get(key)
    return default if value is None else _decode(value)


TIMEOUT_ENV_VAR = "RINGWEAVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # the built-in deadline of collectives and point-to-point calls


def timeout_s(default: float = DEFAULT_TIMEOUT_S) -> float:
    """The default deadline of collectives and point-to-point calls, in seconds: ``RINGWEAVE_TIMEOUT_S``
    as it is now (not when a module was imported), ``default`` when it is unset or empty.

    Raises:
        ValueError: the variable is not a positive number; the message names it and its value.
    """
    return _number(TIMEOUT_ENV_VAR, default, "seconds", lambda v: v > 0,
                   "the deadline must be a positive number of seconds")


MISMATCH_CHECK_ENV_VAR = "RINGWEAVE_MISMATCH_CHECK_S"
DEFAULT_MISMATCH_CHECK_S = 1.0  # see runtime/group.ProcessGroup.check_stalled


def mismatch_check_s(default: float = DEFAULT_MISMATCH_CHECK_S) -> float:
    """How long a collective call may wait before it asks the ranks it waits on which call
    they are in (``ProcessGroup.check_stalled``), in seconds: ``RINGWEAVE_MISMATCH_CHECK_S`` as
    it is now, ``default`` when unset or empty; 0 turns the check off.

    Raises:
        ValueError: the variable is not a number >= 0; the message names it and its value.
    """
    return _number(MISMATCH_CHECK_ENV_VAR, default, "seconds", lambda v: v >= 0,
                   "the check must be 0 (off) or more seconds")


INLINE_WAIT_ENV_VAR = "RINGWEAVE_INLINE_WAIT_US"
DEFAULT_INLINE_WAIT_US = 2000.0  # see runtime/group.Call.sendrecv
SPIN_ENV_VAR = "RINGWEAVE_SPIN_US"
DEFAULT_SPIN_US = 50.0  # see TCPConnection.recv_now; figures in collectives/registry.py


def inline_wait_s(default_us: float = DEFAULT_INLINE_WAIT_US) -> float:
    """How long a collective message may be waited for on its socket, without returning to
    the event loop (``Call.sendrecv``), in seconds: ``RINGWEAVE_INLINE_WAIT_US`` as it is now,
    ``default_us`` when unset or empty; 0 turns that path off.

    Raises:
        ValueError: the variable is not a number >= 0; the message names it and its value.
    """
    return _microseconds(INLINE_WAIT_ENV_VAR, default_us, "the wait")


def spin_s(default_us: float = DEFAULT_SPIN_US) -> float:
    """How much of that wait is spent re-reading the socket (``sched_yield`` between reads)
    before sleeping in ``poll()``, in seconds: ``RINGWEAVE_SPIN_US`` as it is now, ``default_us``
    when unset or empty; 0: sleep at once.

    Raises:
        ValueError: the variable is not a number >= 0; the message names it and its value.
    """
    return _microseconds(SPIN_ENV_VAR, default_us, "the spin")


def _microseconds(name: str, default_us: float, what: str) -> float:
    return _number(name, default_us, "microseconds", lambda v: v >= 0, f"{what} must be 0 or more microseconds") / 1e6


def _number(name: str, default: float, unit: str, ok, must: str) -> float:
    """The variable as a float, ``default`` when unset or empty; ValueError (naming the variable,
    its value and ``must``) when it is not a number or ``ok(value)`` is false (NaN never is)."""
    raw = get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit}") from None
    if not ok(value):
        raise ValueError(f"{name}={raw!r}: {must}")
    return value


PINNED_POOL_ENV_VAR = "RINGWEAVE_PINNED_POOL_MIB"
DEFAULT_PINNED_POOL_MIB = 256.0  # host staging of device collectives: 2 segments x depth x ranks in a process, with room
DEVICE_SEGMENT_ENV_VAR = "RINGWEAVE_DEVICE_SEGMENT_KIB"
DEFAULT_DEVICE_SEGMENT_KIB = 4096.0  # per pipelined step of a device collective (collectives/device.py)
DEVICE_HOST_REDUCE_ENV_VAR = "RINGWEAVE_DEVICE_HOST_REDUCE_KIB"
DEFAULT_DEVICE_HOST_REDUCE_KIB = 256.0  # device all_reduce up to this size reduces on the host (one round trip)


def pinned_pool_bytes(default_mib: float = DEFAULT_PINNED_POOL_MIB) -> int:
    """Bytes of page-locked host memory the device collectives' staging pool may keep:
    ``RINGWEAVE_PINNED_POOL_MIB`` (read when a pool is made), ``default_mib`` when unset or empty.

    Raises:
        ValueError: the variable is not a number >= 0; the message names it and its value.
    """
    return int(_number(PINNED_POOL_ENV_VAR, default_mib, "MiB", lambda v: v >= 0, "the pool must be 0 or more MiB")
               * (1 << 20))


def device_segment_bytes(default_kib: float = DEFAULT_DEVICE_SEGMENT_KIB) -> int:
    """Bytes per pipelined segment of a device collective: ``RINGWEAVE_DEVICE_SEGMENT_KIB`` as it is now.

    Raises:
        ValueError: the variable is not a number >= 4; the message names it and its value.
    """
    return int(_number(DEVICE_SEGMENT_ENV_VAR, default_kib, "KiB", lambda v: v >= 4,
                       "a segment must be 4 KiB or more") * 1024)


def device_host_reduce_bytes(default_kib: float = DEFAULT_DEVICE_HOST_REDUCE_KIB) -> int:
    """The largest device all_reduce that is staged whole and reduced on the host (one copy each way,
    no device fold): ``RINGWEAVE_DEVICE_HOST_REDUCE_KIB`` as it is now; 0: always fold on the device.

    Raises:
        ValueError: the variable is not a number >= 0; the message names it and its value.
    """
    return int(_number(DEVICE_HOST_REDUCE_ENV_VAR, default_kib, "KiB", lambda v: v >= 0,
                       "the size must be 0 or more KiB") * 1024)
