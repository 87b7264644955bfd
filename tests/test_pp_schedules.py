"""Pipeline schedules: complete, deadlock-free, and with the bubble and memory the papers state."""

import pytest

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules import (
    Action,
    all_ranks,
    build_schedule,
    schedule_1f1b,
    send_completion_points,
    validate,
)
from lightning_parallel.pipeline.simulator import simulate

CASES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", CASES)
def test_schedules_are_complete_and_deadlock_free(name, stages, micro_batches):
    validate(all_ranks(name, stages, micro_batches), micro_batches)


@pytest.mark.parametrize("stages,micro_batches,virtual", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 8, 4)])
def test_interleaved_schedule_is_complete_and_deadlock_free(stages, micro_batches, virtual):
    validate(all_ranks("interleaved_1f1b", stages, micro_batches, virtual), micro_batches)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", CASES)
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1_with_equal_costs(name, stages, micro_batches):
    sim = simulate(all_ranks(name, stages, micro_batches), forward_cost=1.0, backward_cost=1.0)
    assert sim.step_time == pytest.approx(2 * (micro_batches + stages - 1))
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1))


@pytest.mark.parametrize("stages,micro_batches,virtual", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (2, 2, 3)])
def test_interleaving_divides_the_bubble_by_v(stages, micro_batches, virtual):
    # each of the V chunks costs 1/V of a stage, so the useful work per rank stays 2 M
    sim = simulate(all_ranks("interleaved_1f1b", stages, micro_batches, virtual), 1 / virtual, 1 / virtual)
    bubble = 2 * (stages - 1) / virtual
    assert sim.step_time == pytest.approx(2 * micro_batches + bubble)
    assert sim.bubble_fraction == pytest.approx(bubble / (2 * micro_batches + bubble))


@pytest.mark.parametrize("stages,micro_batches", CASES)
def test_1f1b_keeps_at_most_p_minus_rank_micro_batches_in_flight(stages, micro_batches):
    sim = simulate(all_ranks("1f1b", stages, micro_batches))
    assert sim.peak_in_flight == [min(stages - r, micro_batches) for r in range(stages)]


@pytest.mark.parametrize("stages,micro_batches", CASES)
def test_gpipe_keeps_all_m_micro_batches_in_flight(stages, micro_batches):
    assert simulate(all_ranks("gpipe", stages, micro_batches)).peak_in_flight == [micro_batches] * stages


def test_1f1b_warmup_is_megatrons_p_minus_rank_minus_1():
    acts = schedule_1f1b(4, 8, rank=1)
    computes = [a for a in acts if a.op in ("F", "B")]
    first_backward = next(i for i, a in enumerate(computes) if a.op == "B")
    assert first_backward == 4 - 1 - 1 + 1  # two warm-up forwards, then the first steady forward


def test_validator_rejects_a_deadlocking_schedule():
    # stage 0 waits for a gradient before sending the activation that produces it
    good = all_ranks("gpipe", 2, 1)
    bad = [[Action("F", 0, 0), Action("recv_b", 0, 0), Action("send_f", 0, 0), Action("B", 0, 0)], good[1]]
    with pytest.raises(PipelineConfigError, match="misplaced|deadlock"):
        validate(bad, 1)
    bad_order = [[Action("F", 0, 0), Action("send_f", 0, 0), Action("recv_b", 0, 0), Action("B", 0, 0)],
                 [Action("recv_f", 0, 1), Action("B", 0, 1), Action("F", 0, 1), Action("send_b", 0, 1)]]
    with pytest.raises(PipelineConfigError, match="precedes"):
        validate(bad_order, 1)


def test_validator_rejects_a_missing_backward():
    acts = all_ranks("1f1b", 2, 2)
    acts[1] = [a for a in acts[1] if not (a.op == "B" and a.microbatch == 1)]
    with pytest.raises(PipelineConfigError, match="B missing"):
        validate(acts, 2)


def test_bad_schedule_requests_name_the_valid_values():
    with pytest.raises(PipelineConfigError, match="gpipe, 1f1b, interleaved_1f1b"):
        build_schedule("zb", 2, 4, 0)
    with pytest.raises(PipelineConfigError, match="divisible"):
        build_schedule("interleaved_1f1b", 4, 6, 0, virtual_stages=2)
    with pytest.raises(PipelineConfigError, match="interleaved_1f1b"):
        build_schedule("1f1b", 2, 4, 0, virtual_stages=2)


def test_timeline_renders_the_simulated_bubble(tmp_path):
    from lightning_parallel.pipeline.timeline import bubble_fraction, render

    sim = simulate(all_ranks("1f1b", 4, 8), 1.0, 2.0)
    assert bubble_fraction(sim.intervals, 4) == pytest.approx(sim.bubble_fraction)
    render(str(tmp_path / "t.png"), 4, 8, "1f1b")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_sent_activation_is_known_delivered_by_the_time_its_gradient_arrives(name, virtual):
    schedules = all_ranks(name, 4, 8, virtual)
    points = send_completion_points(schedules)
    for rank, acts in enumerate(schedules):
        for i, a in enumerate(acts):
            if a.op == "send_f":
                gradient = acts.index(Action("recv_b", a.microbatch, a.stage))
                assert i < points[rank][i] <= gradient


def test_a_send_nobody_answers_is_never_claimed_delivered():
    # the last gradient stage 1 sends to stage 0 is followed by no message back
    schedules = all_ranks("1f1b", 2, 4)
    last_send = max(i for i, a in enumerate(schedules[1]) if a.op == "send_b")
    assert last_send not in send_completion_points(schedules)[1]
