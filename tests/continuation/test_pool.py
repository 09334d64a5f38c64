"""Session routing, fork choice and budget eviction as pure functions, without a model.

Frontiers here are plain data: a token per character, the text as one plain segment, and
an opaque object standing for the state (only its identity matters to the budget).
"""

from __future__ import annotations

import pytest

from ds4jax.chat.segments import Segment
from ds4jax.continuation.pool import Pool, choose_slot, evictions, route
from ds4jax.continuation.types import (
    LIVE_GONE_MESSAGE,
    CacheSource,
    LiveFrontier,
    Rejection,
    RequestView,
    ThinkingBinding,
    ToolBinding,
)
from ds4jax.kvstore.store import DiskHit, NoStore

STATE_BYTES = 100


def frontier(text: str, tokens: tuple[int, ...] | None = None) -> LiveFrontier:
    return LiveFrontier(object(), tokens or tuple(map(ord, text)), (Segment(text),))


def view(text: str, tokens: tuple[int, ...] | None = None, **kw) -> RequestView:
    return RequestView((Segment(text),), tokens or tuple(map(ord, text)), **kw)


def pool(n: int = 4, budget: int | None = None) -> Pool:
    return Pool.create(n, budget=budget, state_nbytes=STATE_BYTES)


def occupy(p: Pool, slot: int, text: str, *, tool_ids: tuple[str, ...] = (), hint=None):
    s = p.sessions[slot]
    s.live = frontier(text)
    s.used = p.tick()
    s.hint = hint
    if tool_ids:
        s.bindings.tool = ToolBinding(frozenset(tool_ids), s.live.pos)
    return s


def tool_view(text: str, ids: tuple[str, ...], requires_live: bool = False) -> RequestView:
    return view(text, tail_ids=ids, tail=(Segment("<result>"),), requires_live=requires_live)


class OneHitStore(NoStore):
    def __init__(self, text: str) -> None:
        self.hit = DiskHit("k", tuple(map(ord, text)), (Segment(text),), load=lambda: None)

    def lookup(self, segments):
        return self.hit if "".join(s.text for s in segments).startswith(self.hit.key) else None


# ------------------------------------------------------------------ routing


def test_tool_result_goes_to_the_session_that_sampled_those_ids():
    p = pool()
    occupy(p, 0, "agent A called", tool_ids=("toolu_a",))
    occupy(p, 1, "agent B called", tool_ids=("toolu_b1", "toolu_b2"))
    occupy(p, 2, "agent C chat")
    r = route(tool_view("agent B called …", ("toolu_b2", "toolu_b1")), p, NoStore())
    assert r.slot == 1 and r.decision.source is CacheSource.LIVE_TOOL
    assert r.decision.base == p.sessions[1].live.tokens and r.displaced is None


def test_a_partial_id_set_does_not_select_a_session_and_needing_it_is_409():
    p = pool()
    occupy(p, 1, "agent B called", tool_ids=("toolu_b1", "toolu_b2"))
    r = route(tool_view("agent B called …", ("toolu_b1",), requires_live=True), p, NoStore())
    assert r == Rejection(409, LIVE_GONE_MESSAGE)


def test_a_fork_point_never_stands_in_for_a_tool_id_mismatch():
    p = pool()
    occupy(p, 0, "agent A called", tool_ids=("toolu_a",))
    p.retain(frontier("agent A"), 0)
    r = route(tool_view("agent A called …", ("toolu_other",), requires_live=True), p, NoStore())
    assert isinstance(r, Rejection) and r.status == 409


def test_a_moved_tool_binding_does_not_match():
    p = pool()
    s = occupy(p, 0, "agent A called and more", tool_ids=("toolu_a",))
    s.bindings.tool = ToolBinding(frozenset({"toolu_a"}), 5)  # the frontier moved on
    r = route(tool_view("agent A called and more …", ("toolu_a",)), p, NoStore())
    assert r.decision.source is CacheSource.TOKEN_PREFIX


def test_the_deepest_live_prefix_wins():
    p = pool()
    occupy(p, 0, "system")
    occupy(p, 1, "system user one")
    occupy(p, 2, "system user")
    r = route(view("system user one more"), p, NoStore())
    assert r.slot == 1 and r.decision.source is CacheSource.TOKEN_PREFIX
    assert r.decision.cached == len("system user one")


def test_a_text_prefix_with_other_tokens_continues_that_session():
    p = pool()
    occupy(p, 2, "hello world")
    r = route(view("hello world!", tokens=(1, 2, 3)), p, NoStore())
    assert r.slot == 2 and r.decision.source is CacheSource.TEXT_PREFIX
    assert r.decision.suffix_segments == (Segment("!"),)


def test_thinking_visible_continues_its_session():
    p = pool()
    s = occupy(p, 3, "prompt<think>reasoning</think>answer")
    s.bindings.thinking = ThinkingBinding((Segment("prompt</think>answer"),), s.live.pos)
    r = route(view("prompt</think>answer<eos>next"), p, NoStore())
    assert r.slot == 3 and r.decision.source is CacheSource.THINKING_VISIBLE


def test_hint_breaks_a_tie_only():
    p = pool()
    occupy(p, 0, "same history", hint="client-a")
    occupy(p, 1, "same history", hint="client-b")  # more recent
    assert route(view("same history+"), p, NoStore(), hint="client-a").slot == 0
    assert route(view("same history+"), p, NoStore()).slot == 1  # no hint: most recent
    occupy(p, 2, "same history and more", hint="client-c")
    # deeper beats a hint
    assert route(view("same history and more+"), p, NoStore(), hint="client-a").slot == 2


def test_a_shared_system_prompt_never_takes_a_live_session_while_one_is_empty():
    p = pool(3)
    occupy(p, 0, "SYSTEM+TOOLS main conversation turn 1")
    p.retain(frontier("SYSTEM+TOOLS main"), 0)
    r = route(view("SYSTEM+TOOLS sub-agent task"), p, NoStore())
    assert r.slot == 1 and r.decision.source is CacheSource.COLD and r.displaced is None


def test_cold_goes_to_the_least_recently_used_session_when_all_are_used():
    p = pool(3)
    occupy(p, 0, "a")
    occupy(p, 1, "b")
    occupy(p, 2, "c")
    p.sessions[1].used = p.tick()  # b used most recently, a least
    r = route(view("zzz"), p, NoStore())
    assert r.slot == 0 and r.displaced is p.sessions[0].live


def test_a_fork_point_forks_a_new_session_and_never_overwrites_its_owner():
    p = pool(3)
    owner = occupy(p, 0, "prompt one sampled reply")  # moved on past its prompt end
    p.retain(frontier("prompt one"), 0)
    r = route(view("prompt one"), p, NoStore())  # a retry of the same prompt
    assert r.decision.source is CacheSource.FORK and r.fork.owner == 0
    assert r.slot == 1 and r.displaced is None
    assert r.decision.cached == len("prompt one") and r.decision.suffix_tokens == ()
    occupy(p, 1, "x")
    occupy(p, 2, "y")
    owner.used = 0  # the owner is the least recently used: still not taken
    r = route(view("prompt one again"), p, NoStore())
    assert r.slot == 1 and r.displaced is p.sessions[1].live


def test_a_pool_of_one_forks_into_its_only_slot():
    p = pool(1)
    occupy(p, 0, "prompt reply")
    p.retain(frontier("prompt"), 0)
    r = route(view("prompt retry"), p, NoStore())
    assert r.slot == 0 and r.decision.source is CacheSource.FORK
    assert r.displaced is p.sessions[0].live


def test_the_deepest_fork_point_wins_and_text_prefixes_count():
    p = pool()
    occupy(p, 0, "conversation moved elsewhere")
    p.retain(frontier("sys tools"), 0)
    p.retain(frontier("sys tools user asks", tokens=(9,) * 30), 0)
    r = route(view("sys tools user asks again"), p, NoStore())
    assert r.decision.source is CacheSource.FORK
    assert r.fork.frontier.tokens == (9,) * 30
    assert r.decision.suffix_segments == (Segment(" again"),)


def test_a_live_prefix_comes_before_a_deeper_fork_point():
    p = pool()
    occupy(p, 0, "abc")
    p.retain(frontier("abcdef"), 1)
    r = route(view("abcdefg"), p, NoStore())
    assert r.slot == 0 and r.decision.source is CacheSource.TOKEN_PREFIX


def test_fork_points_come_before_disk_and_disk_before_cold():
    p = pool()
    store = OneHitStore("k")
    assert route(view("k-long"), p, store).decision.source is CacheSource.DISK
    p.retain(frontier("k-"), 0)
    assert route(view("k-long"), p, store).decision.source is CacheSource.FORK
    assert route(view("other"), p, store).decision.source is CacheSource.COLD


def test_retain_keeps_one_point_per_token_sequence():
    p = pool()
    p.retain(frontier("abc"), 0)
    p.retain(frontier("abc"), 2)
    assert len(p.forks) == 1 and p.forks[0].owner == 2
    p.keep_forks = False
    p.retain(frontier("abcd"), 0)
    assert len(p.forks) == 1


def test_choose_slot_prefers_empty_then_lru_then_the_avoided_one():
    p = pool(2)
    assert choose_slot(p) == 0
    occupy(p, 0, "a")
    assert choose_slot(p, avoid=1) == 1  # empty beats everything
    occupy(p, 1, "b")
    assert choose_slot(p) == 0
    assert choose_slot(p, avoid=0) == 1


def test_a_pool_needs_a_session():
    with pytest.raises(ValueError):
        Pool.create(0)


# ------------------------------------------------------------------ budget


def test_budget_drops_fork_points_lru_first_then_idle_sessions():
    p = pool(3, budget=3 * STATE_BYTES)
    occupy(p, 0, "a")
    occupy(p, 1, "b")
    p.retain(frontier("old"), 0)
    p.retain(frontier("new"), 1)
    assert p.state_bytes() == 4 * STATE_BYTES
    forks, slots = evictions(p, keep=1)
    assert [f.frontier.segments[0].text for f in forks] == ["old"] and slots == []
    p.budget = STATE_BYTES
    forks, slots = evictions(p, keep=1)
    assert len(forks) == 2 and slots == [0]  # the served session stays


def test_a_fork_point_sharing_a_live_state_frees_nothing_and_is_kept():
    p = pool(2, budget=2 * STATE_BYTES)
    s = occupy(p, 0, "prompt")
    p.retain(s.live, 0)  # the prompt end is still the live frontier (nothing decoded)
    occupy(p, 1, "other")
    p.retain(frontier("x"), 1)
    forks, slots = evictions(p, keep=1)
    assert [f.frontier.segments[0].text for f in forks] == ["x"] and slots == []


def test_the_budget_is_never_exceeded_after_evictions():
    p = pool(4, budget=2 * STATE_BYTES)
    for i in range(4):
        occupy(p, i, f"s{i}")
        p.retain(frontier(f"f{i}"), i)
    forks, slots = evictions(p, keep=3)
    p.forks = [f for f in p.forks if f not in forks]
    for i in slots:
        p.sessions[i].clear()
    assert p.state_bytes() <= p.budget and p.sessions[3].live is not None
    assert slots == [0, 1, 2][: len(slots)]


def test_stats_report_sessions_bytes_forks_and_hits():
    p = pool(2)
    occupy(p, 0, "a")
    p.retain(frontier("a-prompt"), 0)
    p.hits[CacheSource.FORK.value] += 2
    st = p.stats()
    assert st["sessions"] == 2 and st["sessions_in_use"] == 1 and st["fork_points"] == 1
    assert st["state_bytes"] == 2 * STATE_BYTES and st["hits"]["fork-point"] == 2
    assert set(st["hits"]) == {s.value for s in CacheSource}


def test_a_session_waiting_for_tool_results_is_given_up_last():
    p = pool(3)
    occupy(p, 0, "waiting agent", tool_ids=("toolu_w",))  # least recently used
    occupy(p, 1, "finished chat")
    occupy(p, 2, "another waiting agent", tool_ids=("toolu_v",))
    assert route(view("new conversation"), p, NoStore()).slot == 1
    p.sessions[1].bindings.tool = ToolBinding(frozenset({"toolu_x"}), p.sessions[1].live.pos)
    assert route(view("new conversation"), p, NoStore()).slot == 0  # then LRU
    p.budget = STATE_BYTES
    p.sessions[1].bindings.tool = None
    assert evictions(p, keep=2) == ([], [1, 0])
