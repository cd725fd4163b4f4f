"""holdback.risk: when a batch is at risk of missing its window."""

from holdback.risk import MARGIN, RELEASE, pace

NOW = 1_000_000.0


def test_a_batch_on_pace_is_not_at_risk_and_one_behind_it_is():
    # 100 s in, 300 s left, 200 of 1000 done: 2/s, the 800 left need 400 s > 0.9 x 300.
    behind = pace(NOW, NOW - 100, NOW + 300, 1000, 199)  # 801 left at (199 + 1) per 100 s: 400.5 s
    assert (behind.left, behind.needs, behind.at_risk) == (801, 400.5, True) and behind.rate == 1.99
    ahead = pace(NOW, NOW - 100, NOW + 300, 1000, 499)  # 501 left at 5/s: 100.2 s
    assert not ahead.at_risk and ahead.needs == 100.2


def test_the_margin_marks_a_batch_before_its_projection_reaches_the_end():
    just = pace(NOW, NOW - 100, NOW + 100, 1000, 499)  # 501 left at 5/s: 100.2 s, the time left
    assert just.at_risk and MARGIN < 1


def test_nothing_finished_is_at_risk_only_when_even_one_finishing_now_would_not_do():
    # A 300 s window, 15 s in, nothing done: 10 left at 1 per 15 s need 150 s of the 285 s left. Not yet.
    assert not pace(NOW, NOW - 15, NOW + 285, 10, 0).at_risk
    stalled = pace(NOW, NOW - 60, NOW + 240, 10, 0)  # 600 s needed, 240 s left
    assert stalled.at_risk and stalled.rate == 0.0 and stalled.needs == 600.0
    # A day's batch with nothing done after 5 minutes of saturated realtime is not judged yet; after two hours it is.
    assert not pace(NOW, NOW - 300, NOW + 86400 - 300, 361, 0).at_risk
    assert pace(NOW, NOW - 7200, NOW + 86400 - 7200, 361, 0).at_risk


def test_before_the_grace_nothing_is_judged():
    early = pace(NOW, NOW - 10, NOW + 3600, 10, 0)  # the grace: a twentieth of the window
    assert not early.at_risk and early.rate is None
    assert not pace(NOW, NOW - 4319, NOW + 86400 - 4319, 10 ** 6, 0).at_risk
    assert pace(NOW, NOW - 4321, NOW + 86400 - 4321, 10 ** 6, 0).at_risk


def test_done_unstarted_or_past_its_window_is_never_at_risk():
    assert not pace(NOW, NOW - 100, NOW + 10, 10, 10).at_risk
    assert not pace(NOW, None, NOW + 10, 10, 0).at_risk
    assert not pace(NOW, NOW - 100, NOW - 1, 10, 0).at_risk  # expiry's business now
    assert not pace(NOW, NOW - 100, None, 10, 0).at_risk


def test_a_marked_batch_stays_at_risk_until_its_projection_leaves_the_wider_margin():
    # 501 left at 5/s need 100.2 s of the 125 s left: 0.8 of it. Not at risk when first judged; kept when marked.
    assert not pace(NOW, NOW - 100, NOW + 125, 1000, 499).at_risk
    assert pace(NOW, NOW - 100, NOW + 125, 1000, 499, marked=True).at_risk
    assert not pace(NOW, NOW - 100, NOW + 200, 1000, 499, marked=True).at_risk  # 0.5 of it: released
    assert RELEASE < MARGIN
