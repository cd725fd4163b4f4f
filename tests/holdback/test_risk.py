"""holdback.risk: when a batch is at risk of missing its window."""

from holdback.risk import GRACE_CAP, MARGIN, RELEASE, pace

NOW = 1_000_000.0


def test_a_batch_on_pace_is_not_at_risk_and_one_behind_it_is():
    # 100 s in, 300 s left, 200 of 1000 done: 2/s, the 800 left need 400 s > 0.9 x 300.
    behind = pace(NOW, NOW - 100, NOW + 300, 1000, 200)
    assert (behind.left, behind.rate, behind.needs, behind.at_risk) == (800, 2.0, 400.0, True)
    ahead = pace(NOW, NOW - 100, NOW + 300, 1000, 500)  # 500 left at 5/s: 100 s
    assert not ahead.at_risk and ahead.needs == 100.0


def test_the_margin_marks_a_batch_before_its_projection_reaches_the_end():
    just = pace(NOW, NOW - 100, NOW + 100, 1000, 500)  # 500 left at 5/s: 100 s, exactly the time left
    assert just.at_risk and MARGIN < 1


def test_nothing_finished_after_the_grace_is_at_risk_and_before_it_nothing_is_judged():
    stalled = pace(NOW, NOW - 120, NOW + 3600, 10, 0)
    assert stalled.at_risk and stalled.needs == float("inf")
    early = pace(NOW, NOW - 10, NOW + 3600, 10, 0)  # the grace: 5% of the window, at most a minute
    assert not early.at_risk and early.rate is None
    assert not pace(NOW, NOW - GRACE_CAP + 1, NOW + 86400, 10, 0).at_risk
    assert pace(NOW, NOW - GRACE_CAP - 1, NOW + 86400, 10, 0).at_risk


def test_done_unstarted_or_past_its_window_is_never_at_risk():
    assert not pace(NOW, NOW - 100, NOW + 10, 10, 10).at_risk
    assert not pace(NOW, None, NOW + 10, 10, 0).at_risk
    assert not pace(NOW, NOW - 100, NOW - 1, 10, 0).at_risk  # expiry's business now
    assert not pace(NOW, NOW - 100, None, 10, 0).at_risk


def test_a_marked_batch_stays_at_risk_until_its_projection_leaves_the_wider_margin():
    # 500 left at 5/s need 100 s of the 125 s left: 0.8 of it. Not at risk when first judged; kept when marked.
    assert not pace(NOW, NOW - 100, NOW + 125, 1000, 500).at_risk
    assert pace(NOW, NOW - 100, NOW + 125, 1000, 500, marked=True).at_risk
    assert not pace(NOW, NOW - 100, NOW + 200, 1000, 500, marked=True).at_risk  # 0.5 of it: released
    assert RELEASE < MARGIN
