"""Pipeline schedules as tables (gw.schedules): each runs every micro-batch through every chunk,
and its simulated bubble is the paper's (1F1B: (p - 1) / (m + p - 1); interleaved: (p - 1) /
(v m + p - 1), Megatron-LM §2.2; ZB-H1: at most half of 1F1B's and ZB-V a quarter from m = 2p, at 1F1B's peak memory, Qi et al.)."""
import math

import pytest

import gridweave as gw
from gridweave import schedules as S


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_simulated_bubbles_are_the_papers(p, k):
    m = k * p
    one = S.simulate(S.one_f_one_b(p, m))  # F = B = W: BW takes twice a forward
    assert math.isclose(one.bubble, (p - 1) / (m + p - 1), rel_tol=1e-12)
    assert all(math.isclose(b, (p - 1) / (m + p - 1), rel_tol=1e-12) for b in one.bubbles)  # every stage alike
    for v in (2, 4):  # v chunks a stage, each 1/v of the work
        inter = S.simulate(S.interleaved(p, m, v), 1 / v, 1 / v, 1 / v)
        assert math.isclose(inter.bubble, (p - 1) / (v * m + p - 1), rel_tol=1e-12)
    zb = S.simulate(S.zb_h1(p, m))
    assert zb.bubble <= one.bubble / 2, (zb.bubble, one.bubble)
    # its peak activations are 1F1B's stage 0's (p micro-batches) on every stage
    assert S.peaks(S.zb_h1(p, m)) == (min(p, m),) * p
    assert S.peaks(S.one_f_one_b(p, m)) == tuple(min(p - s, m) for s in range(p))
    v = S.zbv(p, m)  # two chunks a stage in a V, each half a stage's work
    assert [v.virtual(s, 1) for s in range(p)] == [2 * p - 1 - s for s in range(p)]
    zbv = S.simulate(v, 0.5, 0.5, 0.5)
    if k >= 2:  # Qi et al.'s near zero bubble, from m = 2p: at most a quarter of 1F1B's
        assert zbv.bubble <= one.bubble / 4, (zbv.bubble, one.bubble)
        assert S.peaks(v) == (2 * p,) * p  # 2p half-stage activations: 1F1B's stage 0's p micro-batches
        # DualPipeV on one stream (each overlapped pair run in turn): ZB-V's bubble, its peak half a
        # micro-batch more (DeepSeek-V3's 2p + 1 chunk activations)
        dual = S.dualpipev(p, m)
        assert math.isclose(S.simulate(dual, 0.5, 0.5, 0.5).bubble, zbv.bubble, rel_tol=1e-9)
        assert S.peaks(dual) == (2 * p + 1,) * p
    else:
        assert zbv.bubble <= zb.bubble + 1e-12
        with pytest.raises(gw.GridError, match="DualPipeV needs at least twice the"):
            S.dualpipev(p, m)


def test_a_message_time_delays_each_stage_boundary():
    for p, m in ((2, 4), (4, 8)):
        base, slow = S.simulate(S.one_f_one_b(p, m)), S.simulate(S.one_f_one_b(p, m), t_msg=0.5)
        # the fill and the drain cross p - 1 boundaries each way, a message later each; no op waits
        # on more than one message, and every op of the longest chain is one of m + p - 1 rounds
        assert 2 * (p - 1) * 0.5 <= slow.span - base.span <= 2 * (m + p - 1) * 0.5, (slow.span, base.span)


@pytest.mark.parametrize("p,m", [(2, 1), (4, 3), (4, 8), (3, 5)])
def test_shared_stages_run_at_the_speed_of_how_many_run(p, m):
    """Processor sharing: at a rate of 1 the shared simulation is the plain one (op by op); at a
    constant rate c every time is 1/c; one micro-batch runs its stages one after another, each
    alone (the sum of the stages' own F and BW at speed(1)); stages of their own times are
    honoured (a slower last stage lengthens the span by at least its extra)."""
    for table in (S.one_f_one_b(p, m), S.zb_h1(p, m)):
        plain = S.simulate(table, t_msg=0.25)
        same = S.simulate(table, t_msg=0.25, speed=lambda k: 1.0)
        assert same.span == pytest.approx(plain.span, rel=1e-12)
        assert same.busy == pytest.approx(plain.busy, rel=1e-12)
        assert S.simulate(table, speed=lambda k: 4.0).span == pytest.approx(S.simulate(table).span / 4, rel=1e-12)
    f = tuple(1.0 + s for s in range(p))  # stage s's forward takes 1 + s
    alone = S.simulate(S.one_f_one_b(p, 1), f, f, f, speed=lambda k: 5.0 if k == 1 else 1.0)
    assert alone.span == pytest.approx(3 * sum(f) / 5, rel=1e-12)
    slow_last = (1.0,) * (p - 1) + (2.0,)
    assert S.simulate(S.one_f_one_b(p, m), slow_last, slow_last, slow_last).span >= \
        S.simulate(S.one_f_one_b(p, m)).span + 3 * m * 1.0 - 1e-12
    with pytest.raises(gw.GridError, match="one op time per stage"):
        S.simulate(S.one_f_one_b(p, m), (1.0,) * (p + 1))


@pytest.mark.parametrize("p,m", [(2, 1), (4, 3), (3, 5)])
def test_a_shared_ops_wire_share_is_not_sped_up(p, m):
    """An op's `waiting` share (its messages on the wire) goes at one second a second however
    few stages run: all of it waiting, the shared simulation at any speed is the plain one; one
    micro-batch's ops one after another, each alone, take their compute share at speed(1) and
    their wire share whole: F's u + (1 - u) / 5 and BW's twice that, per stage."""
    for table in (S.one_f_one_b(p, m), S.zb_h1(p, m)):
        plain = S.simulate(table, t_msg=0.25)
        wire = S.simulate(table, t_msg=0.25, speed=lambda k: 3.0 + k, waiting=1.0)
        assert wire.span == pytest.approx(plain.span, rel=1e-12)
        same = S.simulate(table, speed=lambda k: 4.0, waiting=0.0)
        assert same.span == pytest.approx(S.simulate(table).span / 4, rel=1e-12)
    u = tuple(0.2 * s for s in range(p))  # stage s waits 0.2 s of each second
    alone = S.simulate(S.one_f_one_b(p, 1), speed=lambda k: 5.0 if k == 1 else 1.0, waiting=u)
    assert alone.span == pytest.approx(sum(3 * (x + (1 - x) / 5) for x in u), rel=1e-12)
    # two stages at once: the wire share of one does not wait for the other's compute
    both = S.simulate(S.one_f_one_b(2, 2), speed=lambda k: 1.0 / k, waiting=(0.0, 1.0))
    assert both.span < S.simulate(S.one_f_one_b(2, 2), speed=lambda k: 1.0 / k).span
    for bad in (1.5, -0.1, (0.5,) * (p + 1)):
        with pytest.raises(gw.GridError, match="waiting is a share|one op time per stage"):
            S.simulate(S.one_f_one_b(p, m), speed=lambda k: 1.0, waiting=bad)


def test_a_table_that_cannot_run_is_one_clear_error():
    t = S.one_f_one_b(2, 2)
    # stage 0 waits on a backward that needs its own later forward
    broken = S.Table(t.name, 2, 2, 1, t.placement, ((S.Op(S.Kind.F, 0, 0), S.Op(S.Kind.BW, 0, 0),
                                                       S.Op(S.Kind.BW, 0, 1), S.Op(S.Kind.F, 0, 1)), t.ops[1]))
    with pytest.raises(gw.GridError, match="runs BW of chunk 0, micro-batch 1 after nothing"):
        S.simulate(broken)
    # stage 0 sends micro-batch 1 only after micro-batch 0's backward; stage 1 wants micro-batch 1 first
    first_backward = (S.Op(S.Kind.F, 0, 0), S.Op(S.Kind.BW, 0, 0), S.Op(S.Kind.F, 0, 1), S.Op(S.Kind.BW, 0, 1))
    stuck = S.Table(t.name, 2, 2, 1, t.placement, (first_backward, (S.Op(S.Kind.F, 0, 1), S.Op(S.Kind.BW, 0, 1),
                                                                   S.Op(S.Kind.F, 0, 0), S.Op(S.Kind.BW, 0, 0))))
    for speed in (None, lambda k: 2.0):
        with pytest.raises(gw.GridError, match="cannot run: every stage waits on another"):
            S.simulate(stuck, speed=speed)
    missing = S.Table(t.name, 2, 2, 1, t.placement, (t.ops[0][:-1], t.ops[1]))
    with pytest.raises(gw.GridError, match="does not run chunk 0, micro-batch 1 through"):
        S.validate(missing)
    for bad in ((1, 4), (2, 0), (4, 2.0)):
        with pytest.raises(gw.GridError, match="needs"):
            S.zb_h1(*bad)
    with pytest.raises(gw.GridError, match="multiple of the 4 stages"):
        S.interleaved(4, 6, 2)
