"""The rendezvous key-value store: the contract and its in-process pieces.

Ranks meet through a small key-value store before any rank-to-rank connection exists: they
publish addresses, count arrivals and wait for each other. Keys are ``str``, values are
``bytes``. This module holds

- :class:`Store`, the contract every store follows (async, every wait bounded, a timeout that
  names the keys still missing: :func:`timeout_error`),
- :class:`MemoryStore`, the contract in one process: tests, single-host tools, and the table
  behind :class:`runtime.store_server.StoreServer` (its ``*_nowait`` methods and ``wait_named``),
- :class:`PrefixStore`, a namespace over another store (one per round, group, collective),
- :class:`BlockingStore`, the same methods without ``await`` for code that is not asyncio,
  driving any store on an event loop it owns (runtime/loopthread.py).

It holds no networking: the protocol, the server and the TCP client are store_protocol.py,
store_server.py and store_tcp.py; ``python -m runtime.store`` runs a standalone server (store_main.py). The behaviour every implementation must show is checked by
``tests/conformance/check_store.py``. Counters follow torch.distributed: :meth:`Store.add` keeps
its value as ASCII decimal bytes (``b"200"``), so ``get`` of a counter returns those bytes.
"""

from __future__ import annotations

import abc
import asyncio
import math
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from runtime.env import DEFAULT_TIMEOUT_S  # every wait that names no timeout waits this long at most
from runtime.errors import ClosedError, StoreError, StoreTimeoutError, WouldBlock
from runtime.loopthread import LoopThread

if sys.argv[:1] == ["-m"] and "runtime.store" in getattr(sys, "orig_argv", ()):
    # python -m runtime.store: runpy would warn that the package's __init__ imported this module first
    warnings.filterwarnings("ignore", "'runtime.store' found in sys.modules", RuntimeWarning)


def resolve_timeout(timeout_s: float | None, default_s: float) -> float:
    """Returns the timeout a call uses: its own, else the store's default.

    Raises:
        ValueError: a negative, NaN or infinite timeout (every wait is bounded).
    """
    t = default_s if timeout_s is None else timeout_s
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise ValueError(f"store timeout must be a finite number of seconds >= 0, got {t!r}")
    return float(t)


def check_key(key: Any) -> str:
    """Raises TypeError unless ``key`` is a ``str``; returns it."""
    if type(key) is not str:
        raise TypeError(f"store keys are str, got {type(key).__name__} {key!r}")
    return key


def check_keys(keys: Any) -> list[str]:
    """Raises TypeError unless ``keys`` is a sequence of ``str`` (a bare str is refused)."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"store keys must be a sequence of str, got a single {type(keys).__name__} {keys!r}")
    return [check_key(k) for k in keys]


def check_value(value: Any) -> bytes:
    """Raises TypeError unless ``value`` is bytes-like; returns it as ``bytes``."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values are bytes, got {type(value).__name__}")


def timeout_error(missing: Sequence[str], waited_s: float, timeout_s: float, where: str) -> StoreTimeoutError:
    """The one shape of a store timeout: which keys, how long, against what limit."""
    shown = ", ".join(repr(k) for k in list(missing)[:20])
    more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    return StoreTimeoutError(
        f"{where}: waited {waited_s:.3f} s (timeout {timeout_s:g} s) for keys still missing: "
        f"{shown}{more}", keys=list(missing), waited_s=waited_s)


class Store(abc.ABC):
    """The rendezvous key-value store contract.

    Keys are ``str``; values are ``bytes``. Every method that may wait has a
    timeout (``timeout_s=None`` means :attr:`default_timeout_s`), so no call
    waits forever. Every method is a cancellation point: cancelling a waiting
    ``get``/``wait`` drops the wait and changes nothing; cancelling a ``set``,
    ``add``, ``compare_set`` or ``delete_key`` of a remote store after its
    request left may or may not have applied it.

    Legal call order: ``(set | get | add | compare_set | wait | check |
    delete_key | num_keys)* -> close -> end``; any call after ``close``
    raises :class:`ClosedError`, and ``close`` again does nothing.
    """

    default_timeout_s: float = DEFAULT_TIMEOUT_S

    @abc.abstractmethod
    async def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key``, replacing what was there, and wakes its waiters.

        Raises:
            TypeError: key not str or value not bytes-like.
            StoreError: the store refused it (e.g. a value past its size limit) or is unreachable.
            ClosedError: the store was closed.
        """

    @abc.abstractmethod
    async def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Returns the value of ``key``, waiting until some caller sets it.

        Raises:
            StoreTimeoutError: ``key`` was still missing after ``timeout_s``; names it.
            StoreError: the store is unreachable.
            ClosedError: the store was closed (also wakes a pending ``get``).
        """

    @abc.abstractmethod
    async def add(self, key: str, amount: int = 1) -> int:
        """Atomically adds ``amount`` to the counter ``key`` (missing counts as 0).

        The value is kept as ASCII decimal bytes, like torch (``b"-3"``).

        Returns:
            the counter after the addition.
        Raises:
            TypeError: ``amount`` is not an int.
            StoreError: the value already under ``key`` is not a decimal integer.
        """

    @abc.abstractmethod
    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """Atomically stores ``desired`` if ``key`` holds ``expected``.

        ``expected=None`` means "only if ``key`` is absent". The swap happens
        when the current state equals ``expected`` (absent for ``None``).

        Returns:
            the value under ``key`` after the call: ``desired`` when the swap
            happened, else the value that was there; ``b""`` when ``key`` is
            absent and stays absent (``expected`` was not ``None``). A caller
            won the swap exactly when the result equals ``desired`` (if
            ``desired`` may be ``b""``, use :meth:`check` to tell absent apart).
        Raises:
            TypeError, StoreError, ClosedError: as :meth:`set`.
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        """Returns once every key in ``keys`` is present.

        Raises:
            StoreTimeoutError: some keys were still missing after ``timeout_s``;
                ``.keys`` lists them, ``.waited_s`` says how long it waited. One
                deadline covers all keys (never one timeout per key).
            StoreError, ClosedError: as :meth:`get`.
        """

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> bool:
        """Returns whether every key in ``keys`` is present, without waiting for them."""

    @abc.abstractmethod
    async def delete_key(self, key: str) -> bool:
        """Removes ``key``. Returns whether it was there."""

    @abc.abstractmethod
    async def num_keys(self) -> int:
        """Returns the number of keys in the whole store (counters included)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases the store; pending waits raise :class:`ClosedError`. Idempotent."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def parse_counter(key: str, value: bytes) -> int:
    """The integer in a counter value.

    Raises:
        StoreError: ``value`` is not ASCII decimal (``add`` on a key that holds other data).
    """
    try:
        text = value.decode("ascii")
        if not text or text.strip() != text or "_" in text:
            raise ValueError
        return int(text)
    except (UnicodeDecodeError, ValueError):
        raise StoreError(
            f"add({key!r}): the value stored under the key is not a decimal integer: "
            f"{value[:40]!r}{'...' if len(value) > 40 else ''}") from None


@dataclass(frozen=True)
class MemoryStoreStatistics:
    keys: int  # number of keys, e.g. 12
    value_nbytes: int  # bytes held in values, e.g. 4096
    waiting: int  # get/wait calls currently waiting, e.g. 3


class MemoryStore(Store):
    """The store contract inside one process and one event loop.

    Waits are per-key futures: a ``set`` wakes only the waiters of its key,
    and nothing polls. All methods must run on one event loop (the loop of
    the first waiting call); drive it from threads through
    :class:`BlockingStore`.
    """

    def __init__(self, default_timeout_s: float = DEFAULT_TIMEOUT_S, *, name: str = "memory store"):
        self.default_timeout_s = resolve_timeout(default_timeout_s, DEFAULT_TIMEOUT_S)
        self.name = name
        self._data: dict[str, bytes] = {}
        self._value_nbytes = 0
        self._waiters: dict[str, set[asyncio.Future]] = {}  # key -> futures of calls waiting for it
        self._waiting = 0
        self._closed = False

    # -- the synchronous core, shared with the TCP server ---------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.name} is closed")

    def _put(self, key: str, value: bytes) -> None:
        old = self._data.get(key)
        if old is not None:
            self._value_nbytes -= len(old)
        self._data[key] = value
        self._value_nbytes += len(value)
        waiters = self._waiters.pop(key, None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def set_nowait(self, key: str, value: bytes) -> None:
        """:meth:`set` without a suspension point (it never waits)."""
        self._check_open()
        self._put(check_key(key), check_value(value))

    def get_nowait(self, key: str) -> bytes:
        """:meth:`get` that never waits.

        Raises:
            WouldBlock: ``key`` is absent.
        """
        self._check_open()
        try:
            return self._data[check_key(key)]
        except KeyError:
            raise WouldBlock(f"{self.name}: key {key!r} is not set") from None

    def add_nowait(self, key: str, amount: int = 1) -> int:
        """:meth:`add` without a suspension point."""
        self._check_open()
        check_key(key)
        if type(amount) is not int:
            raise TypeError(f"add({key!r}): amount must be an int, got {type(amount).__name__}")
        old = self._data.get(key)
        total = (parse_counter(key, old) if old is not None else 0) + amount
        self._put(key, str(total).encode("ascii"))
        return total

    def compare_set_nowait(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """:meth:`compare_set` without a suspension point."""
        self._check_open()
        check_key(key)
        desired = check_value(desired)
        expected = None if expected is None else check_value(expected)
        current = self._data.get(key)
        if current == expected:  # absent == None, or equal bytes
            self._put(key, desired)
            return desired
        return b"" if current is None else current

    def check_nowait(self, keys: Sequence[str]) -> bool:
        self._check_open()
        return all(k in self._data for k in check_keys(keys))

    def delete_key_nowait(self, key: str) -> bool:
        self._check_open()
        old = self._data.pop(check_key(key), None)
        if old is None:
            return False
        self._value_nbytes -= len(old)
        return True

    def num_keys_nowait(self) -> int:
        self._check_open()
        return len(self._data)

    def statistics(self) -> MemoryStoreStatistics:
        return MemoryStoreStatistics(len(self._data), self._value_nbytes, self._waiting)

    # -- the async contract ----------------------------------------------------

    async def set(self, key: str, value: bytes) -> None:
        """See base class."""
        self.set_nowait(key, value)

    async def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """See base class."""
        await self.wait_named([check_key(key)], timeout_s, f"get({key!r})")
        return self._data[key]  # wait() returned with the key present and nothing ran since

    async def add(self, key: str, amount: int = 1) -> int:
        """See base class."""
        return self.add_nowait(key, amount)

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """See base class."""
        return self.compare_set_nowait(key, expected, desired)

    async def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        """See base class."""
        keys = check_keys(keys)
        await self.wait_named(keys, timeout_s, f"wait({len(keys)} keys)")

    async def wait_named(self, keys: list[str], timeout_s: float | None, what: str) -> None:
        """:meth:`wait` whose timeout error names the call ``what`` (e.g. ``"get('k')"``)."""
        self._check_open()
        timeout_s = resolve_timeout(timeout_s, self.default_timeout_s)
        missing = [k for k in keys if k not in self._data]
        if not missing:
            return
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        deadline = loop.time() + timeout_s
        self._waiting += 1
        try:
            while missing:
                fut = loop.create_future()  # woken by a set of any key still missing
                registered = missing
                for k in registered:
                    self._waiters.setdefault(k, set()).add(fut)
                try:
                    async with asyncio.timeout_at(deadline):
                        await fut
                except TimeoutError:
                    missing = [k for k in keys if k not in self._data]
                    if not missing:
                        return
                    raise timeout_error(missing, time.monotonic() - start, timeout_s,
                                        f"{self.name}: {what}") from None
                finally:
                    for k in registered:
                        waiters = self._waiters.get(k)
                        if waiters is not None:
                            waiters.discard(fut)
                            if not waiters:
                                del self._waiters[k]
                self._check_open()
                missing = [k for k in keys if k not in self._data]
        finally:
            self._waiting -= 1

    async def check(self, keys: Sequence[str]) -> bool:
        """See base class."""
        return self.check_nowait(keys)

    async def delete_key(self, key: str) -> bool:
        """See base class."""
        return self.delete_key_nowait(key)

    async def num_keys(self) -> int:
        """See base class."""
        return self.num_keys_nowait()

    async def close(self) -> None:
        """See base class. Pending waits raise :class:`ClosedError`."""
        if self._closed:
            return
        self._closed = True
        waiters, self._waiters = self._waiters, {}
        for futs in waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(ClosedError(f"{self.name} was closed while a call waited on it"))


class PrefixStore(Store):
    """A namespace over another store: key ``k`` is stored as ``f"{prefix}/{k}"``.

    Everything else is delegated, so ``num_keys`` counts the whole underlying
    store (as in torch) and timeout errors name the full, prefixed keys.
    ``close`` closes the underlying store only when ``owns_store=True``:
    prefix stores are usually short-lived views (one per round or group) over
    one shared store.
    """

    def __init__(self, prefix: str, store: Store, *, owns_store: bool = False):
        if type(prefix) is not str or not prefix:
            raise ValueError(f"PrefixStore needs a non-empty str prefix, got {prefix!r}")
        self.prefix = prefix
        self.store = store
        self.owns_store = owns_store
        self._default_timeout_s: float | None = None  # None: the underlying store's default
        self._closed = False

    @property
    def default_timeout_s(self) -> float:  # type: ignore[override]
        """This view's default timeout; the underlying store's unless set on the view."""
        return self.store.default_timeout_s if self._default_timeout_s is None else self._default_timeout_s

    @default_timeout_s.setter
    def default_timeout_s(self, value: float) -> None:
        self._default_timeout_s = resolve_timeout(value, DEFAULT_TIMEOUT_S)

    def _t(self, timeout_s: float | None) -> float | None:
        return self._default_timeout_s if timeout_s is None else timeout_s

    def _k(self, key: str) -> str:
        if self._closed:
            raise ClosedError(f"PrefixStore {self.prefix!r} is closed")
        return f"{self.prefix}/{check_key(key)}"

    async def set(self, key: str, value: bytes) -> None:
        """See base class."""
        await self.store.set(self._k(key), value)

    async def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """See base class."""
        return await self.store.get(self._k(key), self._t(timeout_s))

    async def add(self, key: str, amount: int = 1) -> int:
        """See base class."""
        return await self.store.add(self._k(key), amount)

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """See base class."""
        return await self.store.compare_set(self._k(key), expected, desired)

    async def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        """See base class."""
        await self.store.wait([self._k(k) for k in check_keys(keys)], self._t(timeout_s))

    async def check(self, keys: Sequence[str]) -> bool:
        """See base class."""
        return await self.store.check([self._k(k) for k in check_keys(keys)])

    async def delete_key(self, key: str) -> bool:
        """See base class."""
        return await self.store.delete_key(self._k(key))

    async def num_keys(self) -> int:
        """See base class."""
        if self._closed:
            raise ClosedError(f"PrefixStore {self.prefix!r} is closed")
        return await self.store.num_keys()

    async def close(self) -> None:
        """See base class."""
        if self._closed:
            return
        self._closed = True
        if self.owns_store:
            await self.store.close()


class BlockingStore:
    """The store contract without ``await``, for code that is not asyncio.

    It owns an event loop on a daemon thread and runs an async :class:`Store`
    there; each method blocks the calling thread until that store answers.
    Any number of threads may call it at once. Waits keep the async store's
    timeouts, so no call blocks forever; Ctrl-C in the calling thread cancels
    the call. Do not call it from the loop thread itself.

    Build it with :meth:`create` (any async store made on the owned loop, e.g.
    ``BlockingStore.create(MemoryStore)``; a TCP client: ``runtime.store_tcp.connect_blocking``).
    Grammar: ``create -> (method call)* -> close -> end``.
    """

    def __init__(self, loop_thread: LoopThread, store: Store):
        self._lt = loop_thread
        self.store = store

    @property
    def default_timeout_s(self) -> float:
        """The wrapped store's default timeout (setting it sets the wrapped store's)."""
        return self.store.default_timeout_s

    @default_timeout_s.setter
    def default_timeout_s(self, value: float) -> None:
        self.store.default_timeout_s = value

    @classmethod
    def create(cls, make: Callable[..., Any], *args: Any, **kwargs: Any) -> "BlockingStore":
        """Calls ``make(*args, **kwargs)`` on a new owned loop (awaiting it if it
        returns an awaitable) and wraps the store it returns."""
        lt = LoopThread("ringweave-store")

        async def _make() -> Store:
            made = make(*args, **kwargs)
            if asyncio.iscoroutine(made) or isinstance(made, asyncio.Future):
                made = await made
            return made

        try:
            store = lt.run(_make())
        except BaseException:
            lt.close()
            raise
        return cls(lt, store)

    def set(self, key: str, value: bytes) -> None:
        """See :meth:`Store.set`."""
        self._lt.run(self.store.set(key, value))

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """See :meth:`Store.get`."""
        return self._lt.run(self.store.get(key, timeout_s))

    def add(self, key: str, amount: int = 1) -> int:
        """See :meth:`Store.add`."""
        return self._lt.run(self.store.add(key, amount))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """See :meth:`Store.compare_set`."""
        return self._lt.run(self.store.compare_set(key, expected, desired))

    def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        """See :meth:`Store.wait`."""
        self._lt.run(self.store.wait(keys, timeout_s))

    def check(self, keys: Sequence[str]) -> bool:
        """See :meth:`Store.check`."""
        return self._lt.run(self.store.check(keys))

    def delete_key(self, key: str) -> bool:
        """See :meth:`Store.delete_key`."""
        return self._lt.run(self.store.delete_key(key))

    def num_keys(self) -> int:
        """See :meth:`Store.num_keys`."""
        return self._lt.run(self.store.num_keys())

    def close(self) -> None:
        """Closes the async store, then stops and joins the loop thread. Idempotent."""
        self._lt.close(self.store.close())

    def __enter__(self) -> "BlockingStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # python -m runtime.store runs the standalone store, runtime/store_main.py
    import runpy  # lazy: only this command needs it; run, not imported, as store_main imports this module

    runpy.run_module("runtime.store_main", run_name="__main__", alter_sys=True)
