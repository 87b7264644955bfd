"""Pipeline schedules: complete, deadlock-free, and with the bubble and memory the papers state.

Costs in the simulator: a forward 1, an input-gradient pass B 1, a weight pass W 1, so an unsplit
backward costs 2 (the zero-bubble paper's T_F = T_B = T_W, Qi et al. 2023, arXiv 2401.10241).
"""

import pytest

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules import (
    Action,
    Op,
    all_ranks,
    build_schedule,
    defer_last_weight_pass,
    schedule_1f1b,
    send_completion_points,
    simulate,
    validate,
)

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
    sim = simulate(all_ranks(name, stages, micro_batches), forward_cost=1.0, backward_cost=1.0, weight_cost=0.0)
    assert sim.step_time == pytest.approx(2 * (micro_batches + stages - 1))
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1))


@pytest.mark.parametrize("stages,micro_batches,virtual", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (2, 2, 3)])
def test_interleaving_divides_the_bubble_by_v(stages, micro_batches, virtual):
    # each of the V chunks costs 1/V of a stage (F 1/V, whole backward 2/V), so the work per rank stays 3 M
    sim = simulate(all_ranks("interleaved_1f1b", stages, micro_batches, virtual), 1 / virtual, 1 / virtual, 1 / virtual)
    bubble = 3 * (stages - 1) / virtual
    assert sim.step_time == pytest.approx(3 * micro_batches + bubble)
    assert sim.bubble_fraction == pytest.approx(bubble / (3 * micro_batches + bubble))


@pytest.mark.parametrize("stages,micro_batches", CASES)
def test_1f1b_keeps_at_most_p_minus_rank_micro_batches_in_flight(stages, micro_batches):
    sim = simulate(all_ranks("1f1b", stages, micro_batches))
    assert sim.peak_in_flight == [min(stages - r, micro_batches) for r in range(stages)]


@pytest.mark.parametrize("stages,micro_batches", CASES)
def test_gpipe_keeps_all_m_micro_batches_in_flight(stages, micro_batches):
    assert simulate(all_ranks("gpipe", stages, micro_batches)).peak_in_flight == [micro_batches] * stages


def test_1f1b_warmup_is_megatrons_p_minus_rank_minus_1():
    acts = schedule_1f1b(4, 8, rank=1)
    computes = [a for a in acts if a.op in (Op.F, Op.B)]
    first_backward = next(i for i, a in enumerate(computes) if a.op is Op.B)
    assert first_backward == 4 - 1 - 1 + 1  # two warm-up forwards, then the first steady forward


def test_validator_rejects_a_deadlocking_schedule():
    # stage 0 waits for a gradient before sending the activation that produces it
    good = all_ranks("gpipe", 2, 1)
    bad = [[Action(Op.F, 0, 0), Action(Op.RECV_B, 0, 0), Action(Op.SEND_F, 0, 0), Action(Op.B, 0, 0)], good[1]]
    with pytest.raises(PipelineConfigError, match="misplaced|deadlock"):
        validate(bad, 1)
    bad_order = [[Action(Op.F, 0, 0), Action(Op.SEND_F, 0, 0), Action(Op.RECV_B, 0, 0), Action(Op.B, 0, 0)],
                 [Action(Op.RECV_F, 0, 1), Action(Op.B, 0, 1), Action(Op.F, 0, 1), Action(Op.SEND_B, 0, 1)]]
    with pytest.raises(PipelineConfigError, match="precedes"):
        validate(bad_order, 1)


def test_validator_rejects_a_missing_backward():
    acts = all_ranks("1f1b", 2, 2)
    acts[1] = [a for a in acts[1] if not (a.op is Op.B and a.microbatch == 1)]
    with pytest.raises(PipelineConfigError, match="B missing"):
        validate(acts, 2)


def test_bad_schedule_requests_name_the_valid_values():
    with pytest.raises(PipelineConfigError, match="gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev"):
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
            if a.op is Op.SEND_F:
                gradient = acts.index(Action(Op.RECV_B, a.microbatch, a.stage))
                assert i < points[rank][i] <= gradient


def test_a_send_nobody_answers_is_never_claimed_delivered():
    # the last gradient stage 1 sends to stage 0 is followed by no message back
    schedules = all_ranks("1f1b", 2, 4)
    last_send = max(i for i, a in enumerate(schedules[1]) if a.op is Op.SEND_B)
    assert last_send not in send_completion_points(schedules)[1]


# ---- weight passes and the zero-bubble schedules ----------------------------------------------------
ZB_CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("name,virtual", [("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("stages,micro_batches", ZB_CASES)
def test_zero_bubble_schedules_are_complete_and_deadlock_free(name, virtual, stages, micro_batches):
    if name == "dualpipev":
        micro_batches += 2 * stages  # it needs at least 2P
    schedules = all_ranks(name, stages, micro_batches, virtual)
    validate(schedules, micro_batches)
    if name != "dualpipev":  # every backward has its weight pass (dualpipev splits only its ramps)
        for acts in schedules:
            assert {(a.microbatch, a.stage) for a in acts if a.op is Op.W} == {(a.microbatch, a.stage) for a in acts
                                                                              if a.op is Op.B}


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_cuts_1f1b_bubble_to_a_third_at_1f1b_memory(stages, micro_batches):
    zb = simulate(all_ranks("zb_h1", stages, micro_batches))
    one = simulate(all_ranks("1f1b", stages, micro_batches))
    # 1F1B idles (P - 1)(F + B + W) per rank, ZB-H1 (P - 1)(F + B - W): 3 (P - 1) against P - 1 with unit costs
    assert one.step_time == pytest.approx(3 * micro_batches + 3 * (stages - 1))
    assert zb.step_time == pytest.approx(3 * micro_batches + (stages - 1))
    assert zb.bubble_fraction < one.bubble_fraction
    assert max(zb.peak_in_flight) == max(one.peak_in_flight) == stages  # every rank holds what 1F1B's first holds


def test_zero_bubble_schedules_beat_1f1b_at_p4_m8():
    bubble = {name: simulate(all_ranks(name, 4, 8, v), 1 / v, 1 / v, 1 / v).bubble_fraction
              for name, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2))}
    assert bubble["zb_h1"] < bubble["1f1b"] / 2
    for v_shaped in ("zbv", "dualpipev"):
        assert bubble[v_shaped] < bubble["zb_h1"] and bubble[v_shaped] < bubble["interleaved_1f1b"]


def test_dualpipev_splits_only_its_ramps_and_needs_2p_micro_batches():
    schedules = all_ranks("dualpipev", 4, 16, 2)
    for acts in schedules:
        backwards = sum(a.op is Op.B for a in acts)
        assert 0 < sum(a.op is Op.W for a in acts) < backwards  # the steady state's backwards are whole
    with pytest.raises(PipelineConfigError, match="at least 2 x 4 pipeline stages = 8 micro-batches"):
        build_schedule("dualpipev", 4, 7, 0, virtual_stages=2)


def test_zbv_holds_stages_in_a_v_and_keeps_1f1b_activation_memory():
    schedules = all_ranks("zbv", 4, 8, 2)
    assert [sorted({a.stage for a in acts}) for acts in schedules] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # chunks are half a stage: 2P chunks in flight are the P stages 1F1B keeps on its first rank
    assert simulate(schedules, 0.5, 0.5, 0.5).peak_in_flight == [8, 8, 8, 8]


def test_zbv_needs_two_chunks_per_rank():
    with pytest.raises(PipelineConfigError, match="virtual_stages=2"):
        build_schedule("zbv", 4, 8, 0, virtual_stages=3)


def test_validator_rejects_a_weight_pass_before_its_backward():
    acts = all_ranks("zb_h1", 2, 2)
    w = next(a for a in acts[1] if a.op is Op.W)
    acts[1].remove(w)
    acts[1].insert(0, w)
    with pytest.raises(PipelineConfigError, match="weight pass of micro-batch 0 stage 1 precedes its backward"):
        validate(acts, 2)


def test_validator_rejects_a_repeated_or_foreign_weight_pass():
    acts = all_ranks("zb_h1", 2, 2)
    twice = [acts[0], acts[1] + [Action(Op.W, 0, 1)]]
    with pytest.raises(PipelineConfigError, match="twice"):
        validate(twice, 2)
    foreign = [acts[0] + [Action(Op.W, 0, 1)], acts[1]]
    with pytest.raises(PipelineConfigError, match="lives on rank 1"):
        validate(foreign, 2)


def test_validator_rejects_a_stage_off_its_placement():
    # the V placement puts stage 2 of 4 on rank 1; a looped schedule runs it on rank 0
    with pytest.raises(PipelineConfigError, match="runs recv_f0@2, but stage 2 lives on rank 1"):
        validate(all_ranks("interleaved_1f1b", 2, 2, 2), 2, placement="v")


def test_an_unsplit_backward_costs_b_plus_w_and_frees_its_micro_batch():
    split = defer_last_weight_pass(schedule_1f1b(1, 2, 0))
    assert [a.op for a in split] == [Op.F, Op.B, Op.F, Op.B]  # a single stage has no input gradient to send first
    sim = simulate(all_ranks("1f1b", 1, 2), 1.0, 1.0, 0.5)
    assert sim.step_time == pytest.approx(2 * (1.0 + 1.5)) and sim.peak_in_flight == [1]


def test_the_last_backward_of_a_rank_with_an_input_gradient_gets_a_trailing_weight_pass():
    schedules = [defer_last_weight_pass(acts) for acts in all_ranks("1f1b", 2, 4)]
    assert schedules[0][-1].op is Op.B  # stage 0 sends no input gradient
    assert schedules[1][-3:] == [Action(Op.B, 3, 1), Action(Op.SEND_B, 3, 1), Action(Op.W, 3, 1)]
    validate(schedules, 4)
    # the flush shrinks: stage 0 gets its last gradient a weight pass earlier
    assert simulate(schedules).step_time == simulate(all_ranks("1f1b", 2, 4)).step_time - 1


@pytest.mark.parametrize("name,virtual", [("zb_h1", 1), ("zbv", 2)])
def test_zero_bubble_sends_are_known_delivered_by_their_gradient(name, virtual):
    schedules = all_ranks(name, 4, 8, virtual)
    points = send_completion_points(schedules)
    for rank, acts in enumerate(schedules):
        for i, a in enumerate(acts):
            if a.op is Op.SEND_F and a.stage + 1 < 8 and (virtual == 1 or a.stage != 3):  # stage 3 -> 4 stays on rank 3
                gradient = acts.index(Action(Op.RECV_B, a.microbatch, a.stage))
                assert i < points[rank][i] <= gradient


def test_timeline_draws_weight_passes(tmp_path):
    from lightning_parallel.pipeline.timeline import render

    render(str(tmp_path / "zbv.png"), 4, 8, "zbv", 2)
    assert (tmp_path / "zbv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulator_costs_each_stage_and_each_message_between_ranks():
    # one micro-batch on 2 ranks is a chain: F0, message, F1, B1 (+W1), message, B0 (+W0)
    chain = all_ranks("1f1b", 2, 1)
    assert simulate(chain).step_time == pytest.approx(1 + 1 + 2 + 2)
    assert simulate(chain, message_cost=0.25).step_time == pytest.approx(6 + 2 * 0.25)
    uneven = simulate(chain, forward_cost={0: 1.0, 1: 3.0}, backward_cost={0: 0.0, 1: 1.0}, weight_cost=1.0)
    assert uneven.step_time == pytest.approx(1 + 3 + 2 + 1)
    # a V of one micro-batch crosses ranks 4 times (0>1, 2>3, 3>2, 1>0); the bottom of the V (1>2, 2>1)
    # stays on rank 1 and costs no message
    v = all_ranks("zbv", 2, 1, 2)
    assert simulate(v, message_cost=0.5).step_time == pytest.approx(simulate(v).step_time + 4 * 0.5)
