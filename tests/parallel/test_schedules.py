"""Pipeline schedules as action lists: the lists themselves, their lowering to sends and receives,
the activations each keeps in flight, and the simulation of the lowered lists: their bubble against
(p-1)/(m+p-1), and the lists it refuses (a deadlock, a receive never posted)."""

import numpy as np
import pytest

from mesh_cases import reference, train_mesh
from trainer.parallel import ParallelConfig, executor
from trainer.parallel.schedules import (Action, bubble_formula, format_table, gpipe, in_flight_peak, lower,
                                        one_f_one_b, schedule, simulate, simulate_lists)
from trainer.sharding.accounted import AccountedCollectives


def names(actions):
    return " ".join(str(a) for a in actions)


def test_gpipe_runs_every_forward_then_every_backward():
    assert names(gpipe(2, 0, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert names(gpipe(4, 3, 2)) == "F0 F1 B0 B1"


def test_1f1b_has_warm_up_steady_state_and_cool_down():
    # pp = 4, m = 6, stage 0: 3 warm-up forwards, 3 (F, B) pairs, 3 cool-down backwards
    assert names(one_f_one_b(4, 0, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert names(one_f_one_b(4, 2, 6)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert names(one_f_one_b(4, 3, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert names(one_f_one_b(4, 0, 2)) == "F0 F1 B0 B1"  # fewer micro-batches than stages: warm-up is cut


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (5, 3)])
def test_every_micro_batch_runs_forward_then_backward_once_and_backwards_keep_order(kind, pp, m):
    for stage in range(pp):
        acts = schedule(kind, pp, stage, m)
        assert sorted(str(a) for a in acts) == sorted([f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)])
        for j in range(m):
            assert acts.index(Action("F", j)) < acts.index(Action("B", j))
        assert [a.mb for a in acts if a.kind == "B"] == list(range(m))
        assert acts[-1] == Action("B", m - 1)  # where the data-parallel reduction is launched


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 2), (3, 7)])
def test_in_flight_activations_are_at_most_pp_minus_stage_under_1f1b_and_m_under_gpipe(pp, m):
    for stage in range(pp):
        assert in_flight_peak(one_f_one_b(pp, stage, m)) == min(pp - stage, m)
        assert in_flight_peak(gpipe(pp, stage, m)) == m


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 4), (4, 8), (3, 1), (8, 16)])
def test_the_simulated_bubble_of_equal_stages_is_p_minus_1_over_m_plus_p_minus_1(kind, pp, m):
    makespan, idle = simulate(kind, pp, m, t_f=1.0, t_b=2.0)
    assert makespan == pytest.approx((m + pp - 1) * 3.0)
    for stage_idle in idle:
        assert stage_idle / makespan == pytest.approx(bubble_formula(pp, m))


def test_lowering_posts_receives_ahead_and_launches_sends_right_after_their_compute():
    # 1F1B, pp = 3, stage 1: both activation receives posted at once (peak 2 + 2 ahead), each
    # gradient receive right after its forward's send, each send right after its compute
    assert names(lower(one_f_one_b(3, 1, 2), 3, 1)) == \
        "RECV_F0 RECV_F1 F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 SEND_B0 B1 SEND_B1"
    assert names(lower(gpipe(2, 0, 1), 2, 0)) == "F0 SEND_F0 RECV_B0 B0"
    assert names(lower(gpipe(2, 1, 1), 2, 1)) == "RECV_F0 F0 B0 SEND_B0"
    # 1F1B, pp = 2, stage 1, m = 6: peak 1, so 3 activation receives ahead of the backwards done
    assert names(lower(one_f_one_b(2, 1, 6), 2, 1)) == \
        "RECV_F0 RECV_F1 RECV_F2 F0 B0 RECV_F3 SEND_B0 F1 B1 RECV_F4 SEND_B1 F2 B2 RECV_F5 SEND_B2 " \
        "F3 B3 SEND_B3 F4 B4 SEND_B4 F5 B5 SEND_B5"
    assert names(lower([Action("F", 0)], 3, 1)) == "RECV_F0 F0 SEND_F0"  # evaluation: no gradient comes back
    # every send of one stage meets a receive of its neighbour, posted before the compute that takes it
    for kind in ("gpipe", "1f1b"):
        pp, m = 4, 5
        lists = [lower(schedule(kind, pp, s, m), pp, s) for s in range(pp)]
        for s in range(pp - 1):
            assert [a.mb for a in lists[s] if a.kind == "SEND_F"] == [a.mb for a in lists[s + 1] if a.kind == "RECV_F"]
            assert [a.mb for a in lists[s + 1] if a.kind == "SEND_B"] == [a.mb for a in lists[s] if a.kind == "RECV_B"]
        for s, acts in enumerate(lists):
            for j in range(m):
                if s > 0:
                    assert acts.index(Action("RECV_F", j)) < acts.index(Action("F", j))
                if s < pp - 1:
                    assert acts.index(Action("RECV_B", j)) < acts.index(Action("B", j))
    with pytest.raises(ValueError, match="compute actions only"):
        lower([Action("SEND_F", 0)], 2, 0)
    with pytest.raises(ValueError, match="micro-batch order"):
        lower([Action("F", 1), Action("F", 0)], 2, 0)


def parse(text):
    return [Action(t.rstrip("0123456789"), int(t[len(t.rstrip("0123456789")):])) for t in text.split()]


def test_the_simulation_refuses_lists_that_deadlock_or_take_a_receive_never_posted():
    ok = [parse("F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 B1"), parse("RECV_F0 RECV_F1 F0 B0 SEND_B0 F1 B1 SEND_B1")]
    assert simulate_lists(ok, 1.0, 2.0)[0] == 9.0
    # stage 1 waits on F1's activation, which stage 0 sends only after B0, which needs stage 1's B0
    deadlock = [parse("F0 SEND_F0 RECV_B0 B0 F1 SEND_F1 RECV_B1 B1"),
                parse("RECV_F0 RECV_F1 F1 B1 SEND_B1 F0 B0 SEND_B0")]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_lists(deadlock)
    unposted = [ok[0], parse("RECV_F1 F0 B0 SEND_B0 F1 B1 SEND_B1")]
    with pytest.raises(RuntimeError, match="stage 1's F0 takes a receive its list did not post"):
        simulate_lists(unposted)
    unreceived = [parse("F0 SEND_F0 RECV_B0 B0"), parse("RECV_F0 F0 B0")]  # stage 1 never sends B0's gradient
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_lists(unreceived)
    extra = [parse("F0 SEND_F0 SEND_F0 RECV_B0 B0"), parse("RECV_F0 F0 B0 SEND_B0 SEND_B0")]
    assert simulate_lists(extra)[0] == 6.0  # a repeated send is the same message
    lost = [parse("F0 SEND_F0"), parse("RECV_F0")]  # stage 1 posts the receive and computes nothing on it
    with pytest.raises(RuntimeError, match=r"sent and never received .*\('F', 1, 0\)"):
        simulate_lists(lost)


def test_the_table_prints_each_stage_and_bad_arguments_are_refused():
    assert format_table("1f1b", 2, 3) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedule("interleaved", 2, 0, 4)
    with pytest.raises(ValueError, match="0 <= stage < pp"):
        one_f_one_b(2, 2, 4)
    with pytest.raises(ValueError, match="m >= 1"):
        gpipe(2, 0, 0)


@pytest.mark.timeout(120)
async def test_the_stage_executor_sends_and_receives_where_its_lowered_list_says(monkeypatch):
    """The executor has no placement of its own: given another valid lowering (every activation
    receive posted at the start), its point-to-point calls follow that list, action by action, and
    the step still equals single-process training."""
    ran: dict[int, list] = {0: [], 1: []}  # stage -> the lowered lists it was given, concatenated
    p2p: dict[int, list] = {0: [], 1: []}  # stage -> its sends and receives, in launch order

    def receives_first(actions, pp, stage):
        lowered = lower(actions, pp, stage)
        lowered = [a for a in lowered if a.kind == "RECV_F"] + [a for a in lowered if a.kind != "RECV_F"]
        ran[stage] += lowered
        return lowered

    def recorded(method, kinds):
        def call(self, x, peer, tag):
            p2p[self.rank].append(Action(kinds[tag % 2], tag // 2))
            return method(self, x, peer, tag)
        return call

    monkeypatch.setattr(executor, "lower", receives_first)
    monkeypatch.setattr(AccountedCollectives, "send", recorded(AccountedCollectives.send, ("SEND_F", "SEND_B")))
    monkeypatch.setattr(AccountedCollectives, "recv", recorded(AccountedCollectives.recv, ("RECV_F", "RECV_B")))
    out = await train_mesh("ddp", pp=2, steps=1, parallel=ParallelConfig(schedule="1f1b", micro_batches=4))
    assert names(ran[1][:4]) == "RECV_F0 RECV_F1 RECV_F2 RECV_F3" != names(lower(one_f_one_b(2, 1, 4), 2, 1)[:4])
    for stage in (0, 1):
        assert p2p[stage] == [a for a in ran[stage] if a.kind not in ("F", "B")]
    want_params, want_losses, _ = reference(steps=1)
    for params, results, _, _ in out:
        for got, want in zip(params, want_params):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose([r.loss for r in results], want_losses, rtol=1e-12)
