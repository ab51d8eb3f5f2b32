"""Shared-memory names against another local user (SECURITY.md, "Shared memory"): /dev/shm is
listed by everyone, so a name must not tell the next one, a name taken by someone else is
tried again under a fresh one, and nobody else's file is ever mapped or removed.

The attacker (uid nobody, tests/security/stranger.py) watches /dev/shm with inotify, as a
real one would, and for every name of the job it sees, creates the names that would come
next: the other ranks' control files and the data slots of every size. Before each file had
its own random token, the domain's one token (seen on the first file) told them all, and the
job failed with FileExistsError at its next data-slot growth.
"""

from __future__ import annotations

import errno
import os
import secrets
import time

import numpy as np
import pytest

import collectives as C
from runtime.sharedmem import domains, segments
from runtime.errors import RingweaveError
from tests.security.netutil import squat_shm_names
from tests.security.stranger import NOBODY, Stranger, needs_root

needs_shm = pytest.mark.skipif(not segments.shm_usable(), reason="no writable /dev/shm (or RINGWEAVE_SHM=0)")
pytestmark = pytest.mark.timeout(60)
SIZES = [16, 2_000, 20_000, 200_000, 700_000, 2_000_000]  # float64 elements: the data slot grows 4 times


def _remove_all(prefix: str) -> None:
    for n in os.listdir(segments.SHM_DIR):
        if n.startswith(prefix):
            os.unlink(os.path.join(segments.SHM_DIR, n))


@needs_root
@needs_shm
async def test_names_squatted_by_another_user_do_not_stop_the_job(ranks, monkeypatch):
    job = f"squat-{secrets.token_hex(4)}"
    monkeypatch.setenv("RINGWEAVE_JOB", job)
    prefix = segments.job_prefix(job)

    async def body(g):
        for i, n in enumerate(SIZES):
            x = np.full(n, g.rank + 1 + i, np.float64)
            await C.all_reduce(x, group=g, algorithm="shm")
            assert (x == sum(r + 1 + i for r in range(g.size))).all(), (n, x[:3])
            await __import__("asyncio").sleep(0.1)  # time for the stranger to see the names and act
        return domains.statistics(g)["0d0"]["grows"]

    stranger = Stranger(squat_shm_names, prefix, 4, domains.MIN_DATA_LOG2).start()
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(segments.SHM_DIR, prefix + "ready")):
            assert time.monotonic() < deadline, "the stranger did not start watching"
            time.sleep(0.01)
        grows = await ranks(4, body)
    finally:
        found = stranger.stop()
        _remove_all(prefix)
    print(f"\n   the stranger saw {found['seen']} names of the job and made {found['made']} files")
    assert found["seen"] and found["made"] > 0, found  # it did see the job's names and act on them
    assert grows == [4] * 4


def test_a_taken_name_is_tried_again_with_a_fresh_token(monkeypatch, tmp_path, caplog):
    tokens = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(segments, "_token", lambda: next(tokens))
    path_of = lambda t: str(tmp_path / f"ringweave-j-{t}-g0d0-r1-ctl")  # noqa: E731
    (tmp_path / f"ringweave-j-{'a' * 16}-g0d0-r1-ctl").write_bytes(b"")  # squatted
    seg, token = segments.Segment.create_fresh(path_of, 4096)
    try:
        assert token == "b" * 16 and seg.path == path_of("b" * 16)
        assert (os.stat(seg.path).st_mode & 0o777) == 0o600
        assert "is taken" in caplog.text
    finally:
        seg.unlink()
        seg.close()
    monkeypatch.setattr(segments, "_token", lambda: "c" * 16)  # every name taken: a clear error
    (tmp_path / f"ringweave-j-{'c' * 16}-g0d0-r1-ctl").write_bytes(b"")
    with pytest.raises(RingweaveError, match="were all taken"):
        segments.Segment.create_fresh(path_of, 4096)


def test_names_share_no_token():
    """Each file draws its own token: one name tells nothing of another."""
    names = set()
    for _ in range(50):
        seg, token = segments.Segment.create_fresh(lambda t: os.path.join(segments.SHM_DIR, f"ringweave-t-{t}-g0d0-r0-ctl"),
                                              64)
        names.add(token)
        seg.unlink()
        seg.close()
    assert len(names) == 50 and all(len(t) == 2 * segments.TOKEN_NBYTES for t in names)


@needs_root
def test_another_users_file_is_neither_mapped_nor_removed():
    job = f"own-{secrets.token_hex(4)}"
    path = os.path.join(segments.SHM_DIR, f"{segments.job_prefix(job)}{'d' * 16}-g0d0-r0-ctl")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        with pytest.raises(RingweaveError, match="belongs to uid"):
            segments.Segment.attach(path, 4096)
        assert segments.remove_job_segments(job) == [] and os.path.exists(path)
    finally:
        os.unlink(path)


@needs_root
def test_a_name_another_user_holds_is_left_to_them(monkeypatch):
    """The first name drawn is another user's file: the segment is made under a fresh name, and
    the file keeps its owner and bytes, through the clean-up after a lost peer too."""
    prefix = segments.job_prefix(f"held-{secrets.token_hex(4)}")
    seed = secrets.token_bytes(32)
    tokens = segments.member_tokens(seed, "ctl")
    path_of = lambda t: segments.segment_path(prefix, t, "0d0", 1, "ctl")  # noqa: E731
    held = path_of(tokens[0])
    with open(held, "wb") as f:
        f.write(b"theirs")
    os.chown(held, NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        seg, token = segments.Segment.create_fresh(path_of, 4096, tokens)
        try:
            assert token == tokens[1] and os.stat(seg.path).st_uid == os.geteuid()
            segments.remove_member_segments(prefix, "0d0", 1, seed)  # what the survivors do when rank 1 is lost
            assert not os.path.exists(seg.path)  # this user's: gone
        finally:
            seg.unlink()
            seg.close()
        assert os.stat(held).st_uid == NOBODY.pw_uid
        with open(held, "rb") as f:
            assert f.read() == b"theirs"
    finally:
        os.unlink(held)


def test_a_link_at_a_segments_name_is_neither_followed_nor_mapped(tmp_path):
    """A link planted where a segment will be made, or mapped: creating fails as for any taken
    name (nothing is made or truncated at the link's target), mapping fails, clean-up skips it."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 64)
    link = tmp_path / f"ringweave-j-{'a' * 16}-g0d0-r0-ctl"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        segments.Segment.create(str(link), 4096)
    with pytest.raises(OSError) as err:
        segments.Segment.attach(str(link), 64)
    assert err.value.errno == errno.ELOOP
    assert victim.read_bytes() == b"v" * 64
    dangling = tmp_path / f"ringweave-j-{'b' * 16}-g0d0-r1-ctl"
    dangling.symlink_to(tmp_path / "made-through-the-link")
    with pytest.raises(FileExistsError):
        segments.Segment.create(str(dangling), 4096)
    assert not (tmp_path / "made-through-the-link").exists()
    assert segments.job_segments("j", directory=str(tmp_path)) == []
    assert segments.remove_job_segments("j", directory=str(tmp_path)) == [] and link.is_symlink()
