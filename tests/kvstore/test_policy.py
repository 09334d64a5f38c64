"""ds4's disk-cache arithmetic (its tests ds4_server.c:13870-14395, spec §6.9): the cold save
point, the budget check and the eviction order."""

from __future__ import annotations

import math

from ds4jax.kvstore.policy import (
    Usage,
    chat_anchor,
    eviction_order,
    eviction_score,
    fits_budget,
    store_len,
)

U, A = 7, 8  # <｜User｜>, <｜Assistant｜>
HOUR = 3600.0


def test_store_len_trims_and_aligns_down_or_keeps_the_whole_prompt() -> None:
    assert store_len(11011, 512, 32, 2048) == 10240
    assert store_len(1695, 512, 32, 2048) == 1695  # aligned down below the minimum: all of it
    assert store_len(3500, 512, 0, 1000) == 3000
    assert store_len(3500, 512, 32, 0) == 3468
    assert store_len(3500, 512, 0, 0) == 3500


def test_chat_anchor_is_the_last_user_before_the_first_assistant() -> None:
    codex_like = [0, 1, 1, U, 2, U, 3, A, 4]
    claude_like = [0, 1, 1, 1, U, 2, A, 3]
    assert chat_anchor(codex_like, U, A, 4) == 5
    assert chat_anchor(claude_like, U, A, 4) == 4


def test_chat_anchor_ignores_the_multiturn_tail_and_short_prefixes() -> None:
    tail = [0, 1, U, 2, A, 3, U, 4, A]
    assert chat_anchor(tail, U, A, 2) == 2
    assert chat_anchor(tail, U, A, 4) is None  # below the minimum
    assert chat_anchor([0, 1, U, 2], U, A, 1) is None  # no assistant turn at all
    assert chat_anchor([0, 1, A, U], U, A, 0) is None  # no user before the assistant


def test_a_file_must_fit_the_budget_with_one_percent_slack() -> None:
    assert fits_budget(52 + 100 + 930, 1100)  # 1082 + 11
    assert not fits_budget(52 + 100 + 938, 1100)  # 1090 + 11
    assert not fits_budget(52 + 900 + 40 + 100, 1100)
    assert fits_budget(0, 0)


def test_eviction_removes_the_less_dense_snapshot_first() -> None:
    now = 1e9
    dense = Usage("dense", tokens=4096, size=1000, hits=0, created=now, last_used=now)
    sparse = Usage("sparse", tokens=1024, size=1000, hits=0, created=now, last_used=now)
    assert [u.key for u in eviction_order([dense, sparse], 1500, now)] == ["sparse"]
    assert eviction_score(dense, now) == 4096 / 1000  # a fresh, unused file: tokens / bytes


def test_eviction_protects_the_checkpoint_just_written() -> None:
    now = 1e9
    new = Usage("new", tokens=512, size=1000, hits=0, created=now, last_used=now)
    old = Usage("old", tokens=4096, size=1000, hits=5, created=now, last_used=now)
    assert [u.key for u in eviction_order([new, old], 1500, now, protect="new")] == ["old"]


def test_eviction_does_not_protect_a_checkpoint_larger_than_the_budget() -> None:
    now = 1e9
    big = Usage("big", tokens=4096, size=3000, hits=0, created=now, last_used=now)
    small = Usage("small", tokens=512, size=100, hits=0, created=now, last_used=now)
    assert [u.key for u in eviction_order([big, small], 2000, now, protect="big")] == ["big"]


def test_eviction_score_decays_stale_hits() -> None:
    now = 1e9
    stale = Usage("stale", 1024, 1000, hits=10, created=1.0, last_used=now - 14 * 6 * HOUR)
    fresh = Usage("fresh", 2048, 1000, hits=0, created=now, last_used=now)
    assert eviction_score(stale, now) < eviction_score(fresh, now)
    assert [u.key for u in eviction_order([stale, fresh], 1500, now)] == ["stale"]
    recent = Usage("recent", 1024, 1000, hits=1, created=now, last_used=now - 6 * HOUR)
    assert math.isclose(eviction_score(recent, now), 1.5 * 1024 / 1000)


def test_decayed_hits_tie_and_the_older_file_goes_first() -> None:
    now = 1e9
    a = Usage("a", 1024, 1000, hits=1, created=1.0, last_used=now - 100 * 6 * HOUR)
    b = Usage("b", 1024, 1000, hits=3, created=1.0, last_used=now - 90 * 6 * HOUR)
    assert eviction_score(a, now) == eviction_score(b, now) == 1024 / 1000
    assert [u.key for u in eviction_order([b, a], 1500, now)] == ["a"]


def test_eviction_keeps_aligned_continued_frontiers() -> None:
    now = 1e9
    big = Usage("2048", 2048, 1000, hits=0, created=now, last_used=now)
    small = Usage("512", 512, 1000, hits=0, created=now, last_used=now)
    assert [u.key for u in eviction_order([small, big], 1500, now)] == ["512"]
    assert eviction_order([small, big], 2000, now) == []
