"""The data plane: a connection's bulk bytes moved by worker threads, beside its event loop.

A TCP connection's event loop (runtime/transport.py) parses every header, matches it to a posted
receive, and carries small frames itself. A payload larger than :data:`BULK_MIN_NBYTES` is moved
by one of two threads of the connection instead, as gloo's device loop and NCCL's proxy threads do:

* the **receiver** reads a payload's bytes straight into the buffer its receive posted (or into the
  buffer that keeps a frame nobody has asked for yet) while the transport's reading is paused, so
  the loop reads the stream's next header only after the payload;
* the **sender** writes a frame (header and payload, one ``writev`` at a time) while every later
  frame to that peer queues behind it, so the stream keeps the order the frames were sent in.

Both make their system calls with the GIL released, through a duplicate of the socket's descriptor
that the thread owns, and report to the loop through ``call_soon_threadsafe``: one collective's
sends, receives and reductions of different segments overlap. A job is cut short without a wrong
answer and without breaking the stream: :meth:`RecvJob.divert` sends the bytes still to come to a
scratch buffer, :meth:`SendJob.detach` copies the bytes still to go so that the caller's buffer is
free at once. EOF or a socket error ends the job with that error, and the connection fails as a
lost peer does; a thread waits in ``poll`` in slices of :data:`SLICE_S`, so :meth:`Worker.close`
ends it within one slice.

Off by default (``RINGWEAVE_DATA_PLANE=1`` turns it on): bench/results/dataplane.md#where-the-threads-take-over.

Life of a worker (grammar)::

    Worker(fd, loop) -> submit* -> close -> end        (close joins the thread)

Not here: frames, headers and matching (transport.py, actor.py), arrays (collectives/).
"""

from __future__ import annotations

import collections
import errno
import os
import select
import socket
import threading
from typing import Callable

# A payload is moved by a worker thread from this size, where copying it costs about what the hand-off
# to a thread and back does (bench/results/dataplane.md#where-the-threads-take-over).
BULK_MIN_NBYTES = 1024 * 1024 + 1
SLICE_S = 0.05  # one wait in poll(): how soon a closing worker notices
_CHUNK_NBYTES = 4 * 1024 * 1024  # one system call's share of a job, the longest a divert or detach waits
_DIVERT_NBYTES = 1024 * 1024  # scratch that diverted bytes are read into
LOWAT_MIN_NBYTES = 256 * 1024  # RecvJob: payloads left to read below this wake the thread per packet


class Job:
    """One unit of a worker's work. ``done(error)`` is called on the loop when it ends (error:
    None, or the OSError / EOFError that ended it)."""
    __slots__ = ("done", "lock", "error")

    def __init__(self, done: Callable[[BaseException | None], None]):
        self.done = done
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def run(self, worker: "Worker") -> None:
        raise NotImplementedError


class RecvJob(Job):
    """Read exactly ``need - pos`` more bytes into ``dest[pos:need]`` (``dest`` None: discard them).

    ``lowat_cap`` (0: none): while many bytes are still to come, the socket's SO_RCVLOWAT is raised
    to what is left (at most this), so ``poll`` wakes the thread once per few MiB rather than per
    packet (as the loop's own reads do, transport.py); it is 1 again when the job ends."""
    __slots__ = ("dest", "pos", "need", "lowat_cap")

    def __init__(self, dest: memoryview | None, pos: int, need: int, done, lowat_cap: int = 0):
        super().__init__(done)
        self.dest, self.pos, self.need = dest, pos, need
        self.lowat_cap = lowat_cap

    def divert(self) -> None:
        """From now on the bytes still to come are read into scratch: nothing more lands in ``dest``."""
        with self.lock:
            self.dest = None

    def run(self, worker: "Worker") -> None:
        scratch = None
        lowat = 1
        try:
            while self.pos < self.need:
                if self.lowat_cap:
                    left = self.need - self.pos
                    want = min(left, self.lowat_cap) if left >= LOWAT_MIN_NBYTES else 1
                    if want != lowat:
                        worker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                        lowat = want
                worker.wait(select.POLLIN)
                with self.lock:
                    dest = self.dest
                    if dest is None:
                        if scratch is None:
                            scratch = memoryview(bytearray(_DIVERT_NBYTES))
                        into = scratch[:min(_DIVERT_NBYTES, self.need - self.pos)]
                    else:
                        into = dest[self.pos:min(self.need, self.pos + _CHUNK_NBYTES)]
                    try:
                        n = os.readv(worker.fd, (into,))
                    except (BlockingIOError, InterruptedError):
                        continue
                    self.pos += n
                if n == 0:
                    raise EOFError("the peer closed the connection in the middle of a frame")
        finally:
            if lowat != 1:  # the loop reads the next header: it must wake for its first byte
                try:
                    worker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                except OSError:
                    pass


class SendJob(Job):
    """Write ``head`` then ``payload``: one frame, whole."""
    __slots__ = ("head", "rest", "copied")

    def __init__(self, head: bytes, payload: memoryview, done):
        super().__init__(done)
        self.head = memoryview(head)  # what is still to be sent of the head
        self.rest = payload  # and of the payload
        self.copied = False

    def detach(self) -> None:
        """Copies what is still to be sent, so the caller's buffer may be reused now."""
        with self.lock:
            if self.rest.nbytes and not self.copied:
                self.rest = memoryview(bytearray(self.rest))
                self.copied = True

    def run(self, worker: "Worker") -> None:
        while self.head.nbytes or self.rest.nbytes:
            with self.lock:
                head = self.head
                parts = (head, self.rest[:_CHUNK_NBYTES]) if head.nbytes else (self.rest[:_CHUNK_NBYTES],)
                try:
                    n = os.writev(worker.fd, parts)
                except (BlockingIOError, InterruptedError):
                    n = 0
                h = min(n, head.nbytes)
                self.head = head[h:]
                self.rest = self.rest[n - h:]
            if n == 0:
                worker.wait(select.POLLOUT)


class Worker:
    """One thread running one connection's jobs of one direction, in order."""

    def __init__(self, fd: int, loop, name: str):
        self.sock = socket.socket(fileno=os.dup(fd))  # ours: the transport closing its descriptor
        self.fd = self.sock.fileno()                   # does not hand this number to another file
        self._loop = loop
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._poller = select.poll()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queues ``job`` behind the others.

        Raises:
            OSError: the worker is closed.
        """
        with self._cond:
            if self._closing:
                raise OSError(errno.EBADF, "the connection's data plane is closed")
            self._jobs.append(job)
            self._cond.notify()

    def wait(self, events: int) -> None:
        """Sleeps until the socket is ready for ``events``, at most one slice (on the thread).

        Raises:
            OSError: the worker is closing, or the socket broke (the job ends with it).
        """
        if self._closing:
            raise OSError(errno.ECONNABORTED, "the connection was closed")
        self._poller.register(self.fd, events)  # (registering again changes the events)
        for _, what in self._poller.poll(SLICE_S * 1000.0):
            if what & (select.POLLERR | select.POLLNVAL) and not what & events:
                raise OSError(errno.ECONNRESET, "the connection broke")

    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._jobs and not self._closing:
                        self._cond.wait()
                    if self._closing:
                        return
                    job = self._jobs.popleft()
                try:
                    job.run(self)
                except (OSError, EOFError) as exc:
                    job.error = exc
                self._report(job)
                if job.error is not None:  # the stream is broken: fail what is queued behind it
                    with self._cond:
                        rest, self._jobs = list(self._jobs), collections.deque()
                    for other in rest:
                        other.error = job.error
                        self._report(other)
        finally:
            with self._cond:
                self.sock.close()
                self.fd = -1

    def _report(self, job: Job) -> None:
        try:
            self._loop.call_soon_threadsafe(job.done, job.error)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def close(self, shutdown: bool = False, join_s: float = 5.0) -> None:
        """Ends the thread and joins it: queued jobs are dropped (their ``done`` is not called);
        the one running ends with an error within a slice, at once with ``shutdown`` (the socket
        is shut down both ways first: for a connection that is being closed anyway)."""
        with self._cond:
            self._closing = True
            self._jobs.clear()
            self._cond.notify()
            if shutdown and self.fd >= 0:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if threading.current_thread() is not self._thread:
            self._thread.join(join_s)
