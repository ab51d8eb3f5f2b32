"""runtime.sharedmem.domains and the end of a segment's life, without collectives: a name gone
before a member mapped it, the clean-up after a lost peer, and what a process still owns at exit."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.errors import CollectiveError, CollectiveTimeoutError
from runtime.sharedmem import domains, segments

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


class _Group:
    """What a Domain reads of its group before set-up: rank, id, global ranks, error, abort."""

    def __init__(self, ranks: list[int]):
        self.rank, self.gid, self.ranks = 0, 3, ranks
        self.error = None

    def abort(self, exc, tell_peers: bool = True):
        if self.error is None:
            self.error = exc


class _Call:
    seq, fingerprint = 9, "all_reduce float32[4] sum"


def _domain(ranks: list[int]) -> domains.Domain:
    dom = domains.Domain(_Group(ranks), list(range(len(ranks))), "3d0")
    dom._prefix = segments.job_prefix(f"dom-{secrets.token_hex(4)}")
    return dom


async def test_a_name_gone_with_no_word_from_its_owner_fails_the_group_naming_it(monkeypatch):
    """Member 1's control segment is not there when member 0 comes to map it, and no error comes
    from member 1: after LEFT_WAIT_S the group fails with an error naming the rank and the file."""
    monkeypatch.setattr(domains, "LEFT_WAIT_S", 0.2)
    dom = _domain([4, 5])
    dom._tokens[1]["ctl"] = "0" * 16
    path = segments.segment_path(dom._prefix, "0" * 16, "3d0", 5, "ctl")
    started = time.monotonic()
    with pytest.raises(CollectiveError) as err:
        await dom._attach(_Call(), 1, "ctl", domains.CONTROL_NBYTES)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert f"rank 5's shared-memory segment {path} was gone when this rank came to map it" in str(err.value)
    assert "no error came from rank 5 within 0.2 s" in str(err.value)
    assert dom.group.error is err.value


async def test_a_name_gone_is_the_owners_error_when_it_comes_in_time(monkeypatch):
    monkeypatch.setattr(domains, "LEFT_WAIT_S", 5.0)
    dom = _domain([4, 5])
    dom._tokens[1]["ctl"] = "0" * 16
    theirs = CollectiveTimeoutError("rank 5: the call timed out")

    async def their_word_arrives():
        await asyncio.sleep(0.1)
        dom.group.abort(theirs)

    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as err:
        await asyncio.gather(dom._attach(_Call(), 1, "ctl", domains.CONTROL_NBYTES), their_word_arrives())
    assert err.value is theirs and time.monotonic() - started < 2.0  # not the whole LEFT_WAIT_S


def test_forgetting_a_lost_peer_unlinks_its_names_in_this_domain_only():
    """The names of the lost peer's seed go (whatever try made them); the same pattern under
    another token (another job of the same name, as two torchrun jobs with the default run id
    are: its names in their window between creation and unlinking) stays, as do other domains',
    other ranks' and links."""
    dom = _domain([4, 5, 6])
    seed = secrets.token_bytes(domains.SEED_NBYTES)
    dom._seeds[1] = seed
    name = lambda token, domain, rank, what: segments.segment_path(dom._prefix, token, domain, rank, what)  # noqa: E731
    gone = [name(segments.member_tokens(seed, "ctl")[0], "3d0", 5, "ctl"),
            name(segments.member_tokens(seed, "v17")[3], "3d0", 5, "v17")]
    other_seed = segments.member_tokens(secrets.token_bytes(domains.SEED_NBYTES), "ctl")[0]
    kept = [name(other_seed, "3d0", 5, "ctl"), name("b1" * 8, "3d0", 5, "v17"),
            name(segments.member_tokens(seed, "ctl")[0], "3d1", 5, "ctl"),
            name(segments.member_tokens(seed, "ctl")[0], "3d0", 6, "ctl")]
    link = name(segments.member_tokens(seed, "v18")[0], "3d0", 5, "v18")
    try:
        for path in gone + kept:
            segments.Segment.create(path, 64).close()
        os.symlink(kept[0], link)
        dom.forget_peer(1)  # group rank 1: global rank 5
        assert [os.path.exists(p) for p in gone] == [False, False]
        assert [os.path.exists(p) for p in kept] == [True] * 4 and os.path.islink(link)
    finally:
        for path in gone + kept + [link]:
            segments.unlink_name(path)
            segments._owned_paths.discard(path)


def test_a_peer_lost_before_its_seed_arrived_leaves_every_name():
    dom = _domain([4, 5])
    path = segments.segment_path(dom._prefix, "a1" * 8, "3d0", 5, "ctl")
    try:
        segments.Segment.create(path, 64).close()
        dom.forget_peer(1)
        assert os.path.exists(path)
    finally:
        segments.unlink_name(path)
        segments._owned_paths.discard(path)


def test_a_members_tokens_are_its_seeds_own():
    seed = secrets.token_bytes(domains.SEED_NBYTES)
    ctl, again = segments.member_tokens(seed, "ctl"), segments.member_tokens(seed, "ctl")
    assert ctl == again and len(set(ctl)) == segments.CREATE_TRIES  # the same for every peer, a fresh one per try
    assert all(len(t) == 2 * segments.TOKEN_NBYTES and int(t, 16) >= 0 for t in ctl)
    assert not set(ctl) & set(segments.member_tokens(seed, "v17"))
    assert not set(ctl) & set(segments.member_tokens(secrets.token_bytes(domains.SEED_NBYTES), "ctl"))


def test_what_a_process_still_owns_at_exit_is_unlinked():
    path = os.path.join(segments.SHM_DIR, f"ringweave-exit{os.getpid()}-{secrets.token_hex(4)}")
    code = ("import os; from runtime.sharedmem import segments\n"
            f"segments.Segment.create({path!r}, 4096)\n"
            f"print('made', os.path.exists({path!r}))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=50)
        assert out.returncode == 0 and out.stdout.split() == ["made", "True"], out.stdout + out.stderr
        assert not os.path.exists(path)
    finally:
        segments.unlink_name(path)
