"""Pipeline schedules as action lists: the lists themselves, their lowering to sends and receives,
the activations each keeps in flight, and their bubble in a simulation against (p-1)/(m+p-1)."""

import pytest

from trainer.parallel.schedules import (Action, bubble_formula, format_table, gpipe, in_flight_peak, lower,
                                        one_f_one_b, schedule, simulate)


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


def test_lowering_adds_the_receives_before_and_the_sends_after_each_compute_action():
    assert names(lower(one_f_one_b(3, 1, 2), 3, 1)) == \
        "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 B0 SEND_B0 RECV_B1 B1 SEND_B1"
    assert names(lower(gpipe(2, 0, 1), 2, 0)) == "F0 SEND_F0 RECV_B0 B0"
    assert names(lower(gpipe(2, 1, 1), 2, 1)) == "RECV_F0 F0 B0 SEND_B0"
    # every send of one stage meets a receive of its neighbour
    for kind in ("gpipe", "1f1b"):
        pp, m = 4, 5
        lists = [lower(schedule(kind, pp, s, m), pp, s) for s in range(pp)]
        for s in range(pp - 1):
            assert [a.mb for a in lists[s] if a.kind == "SEND_F"] == [a.mb for a in lists[s + 1] if a.kind == "RECV_F"]
            assert [a.mb for a in lists[s + 1] if a.kind == "SEND_B"] == [a.mb for a in lists[s] if a.kind == "RECV_B"]


def test_the_table_prints_each_stage_and_bad_arguments_are_refused():
    assert format_table("1f1b", 2, 3) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedule("interleaved", 2, 0, 4)
    with pytest.raises(ValueError, match="0 <= stage < pp"):
        one_f_one_b(2, 2, 4)
    with pytest.raises(ValueError, match="m >= 1"):
        gpipe(2, 0, 0)
