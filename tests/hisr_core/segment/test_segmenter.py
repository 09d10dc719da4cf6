"""Segments: the validator, the offline segmenters, and the ``llm`` segmenter against a real
HTTP server on 127.0.0.1 (scripted answers: good, malformed, invalid, 429, 500)."""

from __future__ import annotations

import json

import pytest

from hisr_core.envs import make_environment
from hisr_core.segment.llm import LLMSegmenter
from hisr_core.segment.segmenter import (
    Segment,
    SegmentError,
    by_entropy,
    by_rule,
    by_turn,
    parse_answer,
    segment_offline,
    validate,
)
from tests.chat_server import ChatServer


def segs(*spans):
    return [Segment(a, b, f"goal {i}") for i, (a, b) in enumerate(spans)]


def test_valid_segments_pass():
    validate(segs((0, 1), (2, 2), (3, 5)), 6)
    validate(segs((0, 0)), 1)


@pytest.mark.parametrize("spans, n, message", [
    ([(0, 2), (2, 4)], 5, r"segments 1 and 2 overlap at turns 3-3"),
    ([(0, 1), (3, 4)], 5, r"turns 3-3 are in no segment \(gap between segments 1 and 2\)"),
    ([(2, 4), (0, 1)], 5, r"segment 2 \(from turn 1\) is out of order"),
    ([(0, 1), (3, 2), (3, 4)], 5, r"segment 2 is empty"),
    ([(0, 2), (3, 5)], 5, (r"segment 2 \(turns 4-6\) is out of range: the trajectory has "
                          r"turns 1-5")),
    ([(-1, 2), (3, 4)], 5, r"segment 1 \(turns 0-3\) is out of range"),
    ([(1, 4)], 5, r"turns 1-1 are in no segment \(gap at the start\)"),
    ([(0, 3)], 5, r"turns 5-5 are in no segment \(gap at the end\)"),
    ([], 5, r"no segments"),
])
def test_invalid_segments_are_rejected_saying_which(spans, n, message):
    with pytest.raises(SegmentError, match=message):
        validate(segs(*spans), n)


def test_a_segment_needs_a_short_subgoal():
    with pytest.raises(SegmentError, match="segment 1 has no sub-goal text"):
        validate([Segment(0, 1, "  ")], 2)
    with pytest.raises(SegmentError, match="sub-goal is 201 characters"):
        validate([Segment(0, 1, "x" * 201)], 2)


def test_parse_answer_forms_and_errors():
    good = [{"subgoal": "find the mug", "start_turn": 1, "end_turn": 2},
            {"subgoal": "take it", "start_turn": 3, "end_turn": 3}]
    want = [Segment(0, 1, "find the mug"), Segment(2, 2, "take it")]
    assert parse_answer(json.dumps({"segments": good}), 3) == want
    assert parse_answer(json.dumps(good), 3) == want
    assert parse_answer("```json\n" + json.dumps(good) + "\n```", 3) == want
    with pytest.raises(SegmentError, match="not JSON"):
        parse_answer("Sure! Here are the segments: ...", 3)
    with pytest.raises(SegmentError, match="no list of segments"):
        parse_answer('{"parts": []}', 3)
    with pytest.raises(SegmentError, match="segment 1 lacks integer"):
        parse_answer('[{"subgoal": "x", "start_turn": "1", "end_turn": 3}]', 3)
    with pytest.raises(SegmentError, match="overlap"):
        parse_answer('[{"subgoal": "a", "start_turn": 1, "end_turn": 2},'
                     ' {"subgoal": "b", "start_turn": 2, "end_turn": 3}]', 3)


def test_offline_segmenters():
    actions = ["go to cabinet 1", "open cabinet 1", "go to drawer 1", "take mug 1 from drawer 1",
               "go to countertop 1", "put mug 1 in/on countertop 1"]
    rule = by_rule(actions, ("take", "put", "open"))
    assert [(s.first, s.last) for s in rule] == [(0, 1), (2, 3), (4, 5)]
    assert rule[1].subgoal == "take mug 1 from drawer 1"
    assert [(s.first, s.last) for s in by_turn(actions)] == [(k, k) for k in range(6)]
    # Entropy rises at turns 2 and 5 (0-based): boundaries there, at least 2 turns apart.
    entropy = [0.5, 0.4, 1.5, 1.4, 1.6, 2.5]
    assert [(s.first, s.last) for s in by_entropy(actions, entropy, 0.5, 2)] == \
        [(0, 1), (2, 4), (5, 5)]
    assert [(s.first, s.last) for s in by_entropy(actions, entropy, 0.5, 3)] == [(0, 4), (5, 5)]
    assert len(by_entropy(actions, [1.0] * 6, 0.5, 1)) == 1, "flat entropy: no boundary"
    assert [(s.first, s.last) for s in by_entropy(actions, entropy, 0.0, 1)] == \
        [(0, 1), (2, 3), (4, 4), (5, 5)], "threshold 0: every rise"
    with pytest.raises(ValueError, match="5 entropies for 6 turns"):
        by_entropy(actions, entropy[:5], 0.5, 2)


def test_rule_segments_of_expert_trajectories_span_1_5_to_4_turns():
    env = make_environment("household", max_turns=40)
    tasks = env.make_tasks("train", 120, 0)
    for slip in (0.0, 0.1):
        lengths = []
        for t in tasks:
            turns = [{"action": x.action} for x in env.expert_play(t, slip).turns]
            got = segment_offline("rule", turns, env.state_changing_verbs, 0.5, 2)
            lengths += [s.turns for s in got]
        mean = sum(lengths) / len(lengths)
        assert 1.5 <= mean <= 4, (slip, mean)


def trajectories(n=3):
    """Expert episodes of household as the segmenter reads them."""
    env = make_environment("household", max_turns=40)
    out = []
    for t in env.make_tasks("train", n, 0):
        ep = env.expert_play(t)
        out.append({"instruction": t.instruction, "outcome": 1.0,
                    "turns": [{"observation": x.observation, "response": x.response,
                               "action": x.action} for x in ep.turns]})
    return out


def good_answer(body, n):
    """A valid answer for whatever trajectory the request holds: turns in pairs."""
    m = int(body["messages"][1]["content"].rsplit("The trajectory has ", 1)[1].split()[0])
    return json.dumps({"segments": [{"subgoal": f"part {k}", "start_turn": k,
                                     "end_turn": min(k + 1, m)} for k in range(1, m + 1, 2)]})


def segmenter(server, tmp_path, **kw):
    return LLMSegmenter(server.url, "judge", "HISR_TEST_KEY", tmp_path / "cache",
                        backoff_s=0.01, **kw)


def test_llm_segments_then_a_rerun_makes_no_request(tmp_path):
    rows = trajectories()
    with ChatServer(reply=good_answer) as server:
        first = segmenter(server, tmp_path).segment_all(rows)
        assert len(server.requests) == 3
        body = server.requests[0]["body"]
        assert body["model"] == "judge" and body["temperature"] == 0
        assert body["response_format"]["type"] == "json_schema"
        again = segmenter(server, tmp_path)
        second = again.segment_all(rows)
        assert len(server.requests) == 3, "the cache answers a rerun"
    assert again.stats["cache_hits"] == 3 and again.stats["requests"] == 0
    assert first == second
    for row, res in zip(rows, first, strict=True):
        assert not res["fallback"]
        validate(res["segments"], len(row["turns"]))
        assert res["segments"][0].subgoal == "part 1"


def test_llm_bad_answers_are_retried_then_fall_back_counted(tmp_path):
    rows = trajectories(1)
    n = len(rows[0]["turns"])
    overlap = json.dumps([{"subgoal": "a", "start_turn": 1, "end_turn": 2},
                          {"subgoal": "b", "start_turn": 2, "end_turn": n}])
    # Malformed JSON, then 429, then 500, then a valid answer.
    with ChatServer(["{not json", 429, 500, good_answer({"messages": [
            {}, {"content": f"The trajectory has {n} turns"}]}, 0)]) as server:
        seg = segmenter(server, tmp_path / "a")
        [res] = seg.segment_all(rows)
    assert not res["fallback"]
    assert seg.stats == {"requests": 4, "retries": 2, "invalid_answers": 1, "fallbacks": 0,
                         "transport_failures": 0, "cache_hits": 0}
    # Invalid segments every time: three attempts, then `turn`, counted and cached.
    with ChatServer([overlap] * 3) as server:
        seg = segmenter(server, tmp_path / "b", attempts=3)
        [res] = seg.segment_all(rows)
        assert seg.segment_all(rows) == [res] and len(server.requests) == 3
    assert res["fallback"] and "overlap" in res["reason"]
    assert [(s.first, s.last) for s in res["segments"]] == [(k, k) for k in range(n)]
    assert seg.stats["fallbacks"] == 1 and seg.stats["invalid_answers"] == 3
    # A server answering 500 past the retries: fallback, not cached (it may come back).
    with ChatServer(reply=lambda body, k: 500) as server:
        seg = segmenter(server, tmp_path / "c", max_retries=2)
        [res] = seg.segment_all(rows)
        assert len(server.requests) == 3
    assert res["fallback"] and "no answer after 2 retries" in res["reason"]
    assert seg.stats["transport_failures"] == 1 and not list((tmp_path / "c").glob("**/*.json"))


def test_llm_without_structured_output_asks_for_plain_json(tmp_path):
    with ChatServer(reply=good_answer, reject_response_format=True) as server:
        seg = segmenter(server, tmp_path)
        results = seg.segment_all(trajectories(2))
        assert "response_format" not in server.requests[-1]["body"]
    assert not any(r["fallback"] for r in results) and not seg.structured
