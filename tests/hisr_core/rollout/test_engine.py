"""The batched episode loop and the transformers generation backend."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hisr_core import contracts
from hisr_core.agent.models import train_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.agent.react import parse_action
from hisr_core.envs import make_environment
from hisr_core.rollout import hf
from hisr_core.rollout.cpu import decode_attention
from hisr_core.rollout.engine import Sampling, play, snap_action, success_table
from hisr_core.rollout.hf import HFGenerator
from tests.scripted import ScriptedBackend


@pytest.fixture(scope="module")
def env():
    return make_environment("household", max_turns=25)


def household_tokenizer(env):
    """A small BPE tokenizer trained on a few expert episodes."""
    texts = []
    for t in env.make_tasks("train", 12, 0):
        ep = env.expert_play(t)
        texts += [x.observation for x in ep.turns] + [x.response for x in ep.turns]
    return train_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="module")
def tokenizer(env):
    return household_tokenizer(env)


#: Tiny models' hidden sizes: head size 8, attention through SDPA; head size 32, decode tokens
#: through the compiled kernel (where it builds).
ATTENTION = {"sdpa": 32, "kernel": 128}


def peaky_model(tokenizer, seed=0, hidden=32):
    """A random tiny Llama with large weights, so greedy choices are far from ties (4 query
    heads, 2 KV heads)."""
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      initializer_range=0.5, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(params=list(ATTENTION))
def attention(request):
    """How the generator's decode tokens attend: SDPA, or the compiled kernel (where built)."""
    if request.param == "kernel" and decode_attention.kernel() is None:
        pytest.skip("the decode-attention kernel cannot be built here")
    return request.param


def uses_kernel(gen: HFGenerator, attention: str) -> bool:
    return gen._kernel == (attention == "kernel")


class ReplayExpert(ScriptedBackend):
    """Answers each prompt with the expert's response for the observation the prompt ends
    with; a fixed bad response for tasks listed in ``broken`` (their id is in the system text)."""

    def __init__(self, env, tasks, tokenizer, builder, broken=()):
        super().__init__(tokenizer)
        self.by_prompt = {}
        for t in tasks:
            ep = env.expert_play(t)
            system = builder.system(t.instruction, env.command_grammar)
            turns = []
            for x in ep.turns:
                key = tuple(builder.prompt(system, turns, x.observation).input_ids)
                self.by_prompt[key] = "Thought: hmm" if t.task_id in broken else x.response
                turns.append((x.observation, x.response))

    def answer(self, key, prompt):
        return self.by_prompt.get(tuple(prompt), "Thought: lost")


@pytest.mark.parametrize("grammar", [True, False])
def test_play_records_every_turn_and_refills(env, tokenizer, grammar):
    tasks = env.make_tasks("valid_seen", 7, 0)
    # The replay knows only prompts whose system message is the builder's (grammar or not).
    builder = PromptBuilder(tokenizer, grammar=grammar)
    backend = ReplayExpert(env, tasks, tokenizer, builder, broken={tasks[2].task_id})
    rows = play(env, tasks, backend, builder, Sampling(), batch_size=3, policy="replay")
    assert [r["task_id"] for r in rows] == [t.task_id for t in tasks]
    assert max(backend.polls) == 3, "never more than batch_size episodes at once"
    assert sorted(backend.released) == sorted((t.task_id, 0) for t in tasks)
    for r in rows:
        assert r["n_turns"] == len(r["turns"]) and r["policy"] == "replay"
    good = [r for i, r in enumerate(rows) if i != 2]
    assert all(r["won"] and all(t["admissible"] and t["parsed"] for t in r["turns"]) for r in good)
    bad = rows[2]
    # No parsable action: flagged, inadmissible, and the episode runs to the turn limit.
    assert not bad["won"] and bad["n_turns"] == env.max_turns
    assert all(not t["parsed"] and not t["admissible"] and t["action"] == "" for t in bad["turns"])
    assert bad["turns"][1]["observation"] == "Nothing happens."
    # The oracle distance before and after every turn: from the reset state, chained, down to
    # 0 on a win, unchanged by a turn that did nothing.
    for r, t in zip(rows, tasks, strict=True):
        ep = env.start(t)
        ep.reset()
        turns = r["turns"]
        assert turns[0]["distance_before"] == ep.distance_to_goal() > 0
        assert all(a["distance_after"] == b["distance_before"] for a, b in itertools.pairwise(turns))
    assert all(r["turns"][-1]["distance_after"] == 0 for r in good)
    assert all(t["distance_after"] == t["distance_before"] > 0 for t in bad["turns"])
    table = success_table(rows, env.task_types)
    assert table["success"]["all"] == pytest.approx(6 / 7)
    contracts.to_table(rows, "episodes")  # rows fit the contract


def test_env_workers_play_the_same_episodes(env, tokenizer):
    from hisr_core.envs.workers import EnvWorkers

    tasks = env.make_tasks("valid_seen", 7, 0)
    builder = PromptBuilder(tokenizer)
    backend = ReplayExpert(env, tasks, tokenizer, builder, broken={tasks[2].task_id})
    here = play(env, tasks, backend, builder, Sampling(), batch_size=4)
    with EnvWorkers("household", env.max_turns, {}, 2) as workers:
        there = play(env, tasks, backend, builder, Sampling(), batch_size=4, workers=workers)
        assert not workers._owner, "finished episodes leave their worker"
    assert there == here


def test_env_worker_failure_names_the_worker(env):
    from hisr_core.envs.workers import EnvWorkers

    task = env.make_tasks("valid_seen", 1, 0)[0]
    with EnvWorkers("household", env.max_turns, {}, 1) as workers:
        [(obs, distance)] = workers.start([("a", task)])
        assert obs.startswith("You are in the middle of a room.") and distance > 0
        result = workers.receive_steps(workers.send_steps([("a", "look")]))["a"]
        assert result.observation.startswith("You are in the middle") and not result.done
        workers._owner["ghost"] = 0  # an episode the worker never started
        with pytest.raises(RuntimeError, match="environment worker 0 failed:(.|\n)*KeyError"):
            workers.receive_steps(workers.send_steps([("ghost", "look")]))
        workers._procs[0].kill()
        workers._procs[0].join()
        with pytest.raises(RuntimeError, match="environment worker 0 died"):
            workers.receive_steps(workers.send_steps([("a", "look")]))


def test_batched_greedy_equals_one_at_a_time(tokenizer, attention):
    model = peaky_model(tokenizer, hidden=ATTENTION[attention])
    gen = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id])
    assert uses_kernel(gen, attention)
    prompts = [tokenizer("You arrive at cabinet 1.")["input_ids"],
               tokenizer("You are in the middle of a room. Looking quickly around you")["input_ids"],
               tokenizer("Nothing")["input_ids"]]
    s = Sampling(temperature=0.0, max_new_tokens=12)
    batched = gen.generate(prompts, s)
    single = [gen.generate([p], s)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    for g in batched:
        assert g.entropy >= 0 and len(g.token_ids) <= 12
    # The same as transformers' own greedy decoding of one prompt.
    ref = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ref_new = [t for t in ref[0, len(prompts[0]):].tolist() if t != tokenizer.eos_token_id]
    assert single[0].token_ids == ref_new[: len(single[0].token_ids)]


def test_rows_run_continuously_and_answer_when_done(tokenizer, attention):
    """More requests than rows, of different lengths: each response is handed back on the
    poll that finishes it, a freed row takes the next request, and every response is the
    one the request gets alone."""
    model = peaky_model(tokenizer, seed=4, hidden=ATTENTION[attention])
    texts = ["You arrive at cabinet 1.", "Nothing happens.", "You are in the middle of a room.",
             "On the countertop 1, you see a mug 1.", "You open the fridge 1."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    lengths = [2, 9, 4, 12, 6]
    gen = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id], max_rows=2)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        gen.submit(i, p, Sampling(max_new_tokens=n))
    packed = []
    forward_packed = gen._forward_packed
    gen._forward_packed = lambda step, fill: packed.append((step, fill)) or forward_packed(
        step, fill)
    got, when, polls = {}, {}, 0
    while len(got) < len(prompts):
        polls += 1
        for key, g in gen.poll():
            got[key], when[key] = g, polls
        assert sum(r.sampling is not None for r in gen._rows) <= 2
    alone = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id], max_rows=1)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert got[i].token_ids == alone.generate([p], Sampling(max_new_tokens=n))[0].token_ids
    # A poll computes new prompts (giving their first token), then steps every row once; a
    # prompt arriving while another row decodes shares that row's decode pass.
    assert len(got[0].token_ids) == 2 and when[0] == 1, "back on the poll that ends it"
    assert when[0] < when[1] and when[2] < when[3]
    assert gen._packed and packed and all(len(s) == len(f) == 1 for s, f in packed)
    assert uses_kernel(gen, attention)


def test_rows_left_move_down_into_freed_ones(tokenizer, attention):
    """Once the low rows are released, the rows still held move into them (a decode pass
    spans rows 0..max), the top ones into the gaps; their responses, and the cache a session
    reuses, stay their own."""
    model = peaky_model(tokenizer, seed=7, hidden=ATTENTION[attention])
    eos = tokenizer.eos_token_id
    prompts = [tokenizer(t)["input_ids"] for t in
               ["You arrive at cabinet 1.", "Nothing happens.", "You open the fridge 1.",
                "On the countertop 1, you see a mug 1."]]
    lengths = [1, 2, 12, 12]
    gen = HFGenerator(model, tokenizer, stop_ids=[eos], max_rows=4)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        gen.submit(i, p, Sampling(temperature=0.0, max_new_tokens=n))
    got = {}
    while len(got) < 2:
        got.update(gen.poll())
    assert set(got) == {0, 1} and gen._where == {0: 0, 1: 1, 2: 2, 3: 3}
    gen.release(0)
    gen.release(1)
    spans = []
    forward = gen._forward
    gen._forward = lambda rows, feeds, dense: spans.append(max(rows) + 1) or forward(
        rows, feeds, dense)
    while len(got) < 4:
        got.update(gen.poll())
    assert set(spans) == {2} and uses_kernel(gen, attention)
    assert gen._where == {3: 0, 2: 1}
    alone = HFGenerator(model, tokenizer, stop_ids=[eos], max_rows=1)
    for i in (2, 3):
        assert got[i].token_ids == alone.generate(
            [prompts[i]], Sampling(temperature=0.0, max_new_tokens=12))[0].token_ids
    # The moved row's cache is the session's: the next turn reuses it and answers as fresh.
    more = prompts[2] + got[2].token_ids[:-1] + tokenizer(" Nothing happens.")["input_ids"]
    reused = gen.stats["prompt_tokens_reused"]
    s = Sampling(temperature=0.0, max_new_tokens=8)
    cached = gen.generate([more], s, sessions=[2])[0]
    assert gen.stats["prompt_tokens_reused"] - reused == len(prompts[2]) + 11
    assert cached.token_ids == alone.generate([more], s)[0].token_ids


def test_a_waiting_request_takes_a_freed_row_and_nothing_moves(tokenizer, attention):
    """A new request fills the gap a released key left, instead of the rows above shifting
    down (a copy of their caches)."""
    model = peaky_model(tokenizer, seed=7, hidden=ATTENTION[attention])
    eos = tokenizer.eos_token_id
    prompts = [tokenizer(t)["input_ids"] for t in
               ["You arrive at cabinet 1.", "Nothing happens.", "You open the fridge 1.",
                "On the countertop 1, you see a mug 1."]]
    gen = HFGenerator(model, tokenizer, stop_ids=[eos], max_rows=3)
    assert uses_kernel(gen, attention)
    for i, n in enumerate([1, 12, 12]):
        gen.submit(i, prompts[i], Sampling(temperature=0.0, max_new_tokens=n))
    got = dict(gen.poll())
    assert set(got) == {0}
    gen.release(0)
    moves = []
    move = gen._cache.move
    gen._cache.move = lambda *a: moves.append(a) or move(*a)
    s = Sampling(temperature=0.0, max_new_tokens=12)
    gen.submit(3, prompts[3], s)
    while len(got) < 4:
        got.update(gen.poll())
    assert moves == [] and gen._where == {3: 0, 1: 1, 2: 2}
    alone = HFGenerator(model, tokenizer, stop_ids=[eos], max_rows=1)
    for i in (1, 2, 3):
        assert got[i].token_ids == alone.generate([prompts[i]], s)[0].token_ids


def test_rows_of_very_different_lengths_answer_as_each_alone(tokenizer, attention):
    """A decode pass over rows of very different lengths answers as each prompt alone."""
    model = peaky_model(tokenizer, seed=8, hidden=ATTENTION[attention])
    texts = [("You are in the middle of a room. Looking quickly around you, you see a "
              "cabinet 1, a drawer 1, a countertop 1, a fridge 1 and a sinkbasin 1."),
             "Nothing happens.", "On the countertop 1, you see a mug 1 and a knife 2.", "OK."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    s = Sampling(temperature=0.0, max_new_tokens=10)
    gen = HFGenerator(model, tokenizer, [tokenizer.eos_token_id])
    got = gen.generate(prompts, s)
    assert gen._ragged and uses_kernel(gen, attention)
    alone = HFGenerator(model, tokenizer, [tokenizer.eos_token_id], max_rows=1)
    for p, g in zip(prompts, got, strict=True):
        assert g.token_ids == alone.generate([p], s)[0].token_ids


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ragged_cache_serves_both_mask_kinds(tokenizer, attn):
    model = peaky_model(tokenizer, seed=5)
    model.config._attn_implementation = attn
    gen = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id])
    # Prompts share the decode pass only through the engine's own SDPA attention.
    assert gen._ragged and gen._packed == (attn == "sdpa")
    prompt = tokenizer("You are in the middle of a room. Looking quickly around you")["input_ids"]
    out = gen.generate([prompt, prompt[:4]], Sampling(max_new_tokens=10))
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ref_new = [t for t in ref[0, len(prompt):].tolist() if t != tokenizer.eos_token_id]
    assert out[0].token_ids == ref_new[: len(out[0].token_ids)]


def test_a_bfloat16_kv_cache_under_a_float32_model(tokenizer, attention):
    """The cache is stored and read in bfloat16 while the model computes in float32: greedy
    responses of a peaky model (no near ties) are the float32 cache's, and the model is left
    with its own attention."""
    model = peaky_model(tokenizer, seed=6, hidden=ATTENTION[attention])
    prompts = [tokenizer(t)["input_ids"] for t in
               ["You arrive at cabinet 1.", "You are in the middle of a room. Looking around"]]
    s = Sampling(temperature=0.0, max_new_tokens=10)
    want = HFGenerator(model, tokenizer, [tokenizer.eos_token_id]).generate(prompts, s)
    gen = HFGenerator(model, tokenizer, [tokenizer.eos_token_id], kv_dtype=torch.bfloat16)
    got = gen.generate(prompts, s)
    assert gen._ragged and {k.dtype for k in gen._cache.keys} == {torch.bfloat16}
    assert uses_kernel(gen, attention)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert [g.entropy for g in got] == pytest.approx([g.entropy for g in want], rel=0.05)
    assert model.config._attn_implementation == "sdpa"


def test_a_kv_dtype_of_its_own_needs_sdpa(tokenizer):
    model = peaky_model(tokenizer)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="bfloat16 KV cache under a torch.float32 model needs "
                                         "SDPA attention; this model uses 'eager'"):
        HFGenerator(model, tokenizer, [tokenizer.eos_token_id], kv_dtype=torch.bfloat16)
    # Its own dtype is no cast: any attention serves.
    HFGenerator(model, tokenizer, [tokenizer.eos_token_id], kv_dtype=torch.float32)


def test_kv_dtype_is_what_the_params_say_on_any_machine(tokenizer, attention):
    """The cache dtype follows the value alone, whether or not the kernel serves the model."""
    model = peaky_model(tokenizer, hidden=ATTENTION[attention])
    assert hf.resolve_kv_dtype("bfloat16", model) == torch.bfloat16
    assert hf.resolve_kv_dtype("float32", model) == torch.float32
    assert hf.resolve_kv_dtype("model", model) is None
    gen = HFGenerator(model, tokenizer, [tokenizer.eos_token_id],
                      kv_dtype=hf.resolve_kv_dtype("bfloat16", model))
    assert uses_kernel(gen, attention)
    model.config._attn_implementation = "eager"
    assert hf.resolve_kv_dtype("float32", model) == torch.float32   # the model's own: no cast
    with pytest.raises(ValueError, match="rollout.kv_dtype 'bfloat16' differs from the model's "
                                         "dtype and needs SDPA attention; this model uses "
                                         "'eager': set rollout.kv_dtype to 'model'"):
        hf.resolve_kv_dtype("bfloat16", model)
    with pytest.raises(ValueError, match="unknown rollout.kv_dtype 'auto'; expected one of "
                                         "bfloat16, float32, model"):
        hf.resolve_kv_dtype("auto", model)


@pytest.mark.parametrize("build", ["1", "avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_the_sdpa_fallback_gives_the_kernels_numbers(tokenizer, monkeypatch, kv_dtype, build):
    """A machine without the kernel (``HISR_DECODE_KERNEL=0``) computes what the kernel does
    (its best build, and the 8-lane AVX2 one): both read the stored cache in float32
    arithmetic, so logits agree to float rounding and the same seed samples the same tokens
    (entropies: the logits), packed passes and compaction included."""
    monkeypatch.setenv(decode_attention.SWITCH, build)
    if decode_attention.kernel() is None:
        pytest.skip(f"the decode-attention kernel ({decode_attention.SWITCH}={build}) cannot "
                    "be built here")
    model = peaky_model(tokenizer, seed=3, hidden=ATTENTION["kernel"])
    texts = ["You arrive at cabinet 1.", "You are in the middle of a room. Looking around",
             "On the countertop 1, you see a apple 2, a knife 1.", "Nothing happens.",
             "You open the fridge 1. The fridge 1 is open. In it, you see a egg 1."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]

    def run() -> tuple[HFGenerator, list]:
        gen = HFGenerator(model, tokenizer, [tokenizer.eos_token_id], seed=5, max_rows=3,
                          kv_dtype=kv_dtype)
        out = gen.generate(prompts, Sampling(temperature=1.0, max_new_tokens=12),
                           sessions=list(range(len(prompts))))
        return gen, out

    with_kernel, want = run()
    monkeypatch.setenv(decode_attention.SWITCH, "0")
    without, got = run()
    assert with_kernel._kernel and not without._kernel and without._packed
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert [g.entropy for g in got] == pytest.approx([g.entropy for g in want], rel=1e-4)


def test_a_model_the_ragged_cache_cannot_serve_runs_without_it(tokenizer):
    """Sliding-window attention: the check against a plain forward pass fails, and the
    backend recomputes each step, matching transformers' own greedy decoding."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=3, initializer_range=0.5,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    gen = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id])
    assert not gen._ragged
    prompt = tokenizer("You arrive at cabinet 1. Nothing happens.")["input_ids"]
    out = gen.generate([prompt], Sampling(max_new_tokens=8))[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ref_new = [t for t in ref[0, len(prompt):].tolist() if t != tokenizer.eos_token_id]
    assert out.token_ids == ref_new[: len(out.token_ids)] and out.token_ids


class NoSessions:
    """The same backend with its cross-turn cache turned off: each key is released as soon as
    its response is back, so every prompt is computed whole."""

    def __init__(self, inner):
        self.inner = inner
        self.stats = inner.stats

    def submit(self, key, prompt, sampling):
        self.inner.submit(key, prompt, sampling)

    def poll(self):
        out = self.inner.poll()
        for key, _ in out:
            self.inner.release(key)
        return out

    def release(self, key):
        pass


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged-cache", "no-cache"])
def test_session_cache_gives_the_same_tokens(tokenizer, ragged):
    model = peaky_model(tokenizer, seed=1)
    s = Sampling(temperature=0.0, max_new_tokens=10)
    gen = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id])
    gen._ragged = ragged  # models the ragged cache cannot serve are recomputed each step
    first = [tokenizer("You arrive at cabinet 1.")["input_ids"],
             tokenizer("You are in the middle of a room.")["input_ids"]]
    out = gen.generate(first, s, sessions=["a", "b"])
    more = tokenizer(" Nothing happens. You see a mug 1.")["input_ids"]
    second = [first[0] + out[0].token_ids + more,
              first[1][:3] + more]  # shares only 3 tokens with session b's cache
    cached = gen.generate(second, s, sessions=["a", "b"])
    # A response cut at max_new_tokens leaves its last token uncomputed.
    held = len(out[0].token_ids) - (len(out[0].token_ids) == s.max_new_tokens)
    reused = len(first[0]) + held + 3 if ragged else 0
    assert gen.stats["prompt_tokens_reused"] == reused
    fresh = HFGenerator(model, tokenizer, stop_ids=[tokenizer.eos_token_id]).generate(second, s)
    assert [g.token_ids for g in cached] == [g.token_ids for g in fresh]
    gen.release("a")
    gen.release("b")
    assert not gen._where


def test_play_with_and_without_session_cache_agree(tokenizer):
    env = make_environment("household", max_turns=4)
    tasks = env.make_tasks("valid_seen", 5, 0)
    builder = PromptBuilder(tokenizer, max_tokens=640)  # later turns drop old ones
    s = Sampling(temperature=0.0, max_new_tokens=16)
    model = peaky_model(tokenizer, seed=2)
    cached = HFGenerator(model, tokenizer, builder.stop_ids)
    a = play(env, tasks, cached, builder, s, batch_size=3)
    b = play(env, tasks, NoSessions(HFGenerator(model, tokenizer, builder.stop_ids)), builder, s,
             batch_size=3)
    assert [[t["response"] for t in r["turns"]] for r in a] == \
        [[t["response"] for t in r["turns"]] for r in b]
    assert cached.stats["prompt_tokens_reused"] > cached.stats["prompt_tokens_computed"]
    assert not cached._where, "finished episodes release their rows"


def test_sampling_is_seeded_per_key(tokenizer):
    model = peaky_model(tokenizer)
    prompts = [tokenizer("You arrive at")["input_ids"]] * 4
    s = Sampling(temperature=1.0, top_p=0.9, max_new_tokens=8)
    keys = ["a", "b", "c", "d"]
    a = HFGenerator(model, tokenizer, [tokenizer.eos_token_id], seed=3).generate(prompts, s, keys)
    b = HFGenerator(model, tokenizer, [tokenizer.eos_token_id], seed=3).generate(prompts, s, keys)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert len({tuple(g.token_ids) for g in a}) > 1, "keys draw differently"
    # A key's draw does not depend on what else shares the batch.
    c = HFGenerator(model, tokenizer, [tokenizer.eos_token_id], seed=3, max_rows=1).generate(
        prompts[:1], s, ["c"])
    assert c[0].token_ids == a[2].token_ids


def test_stop_token_ends_response(tokenizer):
    model = peaky_model(tokenizer)
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the argmax everywhere
        model.lm_head.weight[eos] = model.lm_head.weight.abs().max() * 50
        model.model.norm.weight.fill_(1.0)
    out = HFGenerator(model, tokenizer, [eos]).generate([tokenizer("x")["input_ids"]], Sampling())
    assert out[0].token_ids == [] and out[0].text == ""


def test_invalid_sampling_rejected():
    with pytest.raises(ValueError):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError):
        Sampling(temperature=-1)


def test_snap_action_maps_to_the_closest_listed_command():
    obs = "You see a mug 1.\nAdmissible actions: go to cabinet 1, go to cabinet 12, take mug 1 from shelf 1"
    assert snap_action("go to the cabinet 12", obs) == "go to cabinet 12"
    assert snap_action("take mug 1 from the shelf 1", obs) == "take mug 1 from shelf 1"
    assert snap_action("go to cabinet 1", obs) == "go to cabinet 1", "a listed action stays"
    assert snap_action("fly away", "You see a mug 1.") == "fly away", "nothing listed: kept"


class Misspoken(ReplayExpert):
    """The expert's responses with "the " slipped in before the command's last object, which
    the game does not accept (``go to the cabinet 1``)."""

    def answer(self, key, prompt):
        text = super().answer(key, prompt)
        return re.sub(r"(Action: .*?)(\S+ \d+)$", r"\1the \2", text)


def test_snapped_actions_are_played_and_stored():
    env = make_environment("household", max_turns=25, show_admissible=True)
    tok = household_tokenizer(env)
    tasks = env.make_tasks("valid_seen", 4, 0)
    builder = PromptBuilder(tok)
    backend = Misspoken(env, tasks, tok, builder)
    free = play(env, tasks, backend, builder, Sampling(), batch_size=4)
    assert not any(r["turns"][0]["admissible"] for r in free)
    rows = play(env, tasks, backend, builder, Sampling(), batch_size=4, actions="snap")
    assert all(r["won"] for r in rows)
    for t, r in zip(tasks, rows, strict=True):
        expert = env.expert_play(t)
        assert [x["response"] for x in r["turns"]] == [x.response for x in expert.turns]
        assert all(x["admissible"] and x["action"] == parse_action(x["response"])
                   for x in r["turns"])


def test_a_backend_that_cannot_constrain_snaps():
    env = make_environment("household", max_turns=25, show_admissible=True)
    tok = household_tokenizer(env)
    tasks = env.make_tasks("valid_seen", 2, 0)
    builder = PromptBuilder(tok)
    rows = play(env, tasks, Misspoken(env, tasks, tok, builder), builder, Sampling(),
                batch_size=2, actions="constrained")
    assert all(r["won"] and all(x["admissible"] for x in r["turns"]) for r in rows)
    with pytest.raises(ValueError, match="actions must be one of"):
        play(env, tasks, Misspoken(env, tasks, tok, builder), builder, Sampling(),
             batch_size=2, actions="closest")


def bigram_model(tokenizer, chain, seed=0):
    """A tiny Llama whose next-token logits depend only on the last token: its one layer adds
    nothing (zeroed output projections), the embeddings are one-hot, so the head's column of
    that token is the logit table. Each token of ``chain`` strongly predicts the next; other
    logits are small and random (a fixed preference among the rest)."""
    v = len(tokenizer)
    cfg = LlamaConfig(vocab_size=v, hidden_size=v, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    table = torch.rand(v, v)  # table[next, last]
    for last, nxt in itertools.pairwise(chain):
        table[nxt, last] = 20.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(v))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(table / v ** 0.5)  # RMSNorm scales a one-hot by sqrt(v)
    return model


def test_constrained_decoding_picks_the_action_among_the_choices(tokenizer):
    prompt = tokenizer("You see a mug", add_special_tokens=False)["input_ids"]
    wanted = "Action: go to the cabinet 1"  # no thought: a bigram cannot follow two colons
    response = tokenizer(wanted, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    chain = [prompt[-1], *response, eos]
    assert len(set(chain)) == len(chain), "a bigram chain needs distinct tokens"
    gen = HFGenerator(bigram_model(tokenizer, chain), tokenizer, [eos])
    assert gen._ragged, "the bigram model runs on the KV cache like any other"
    free = gen.generate([prompt], Sampling())[0]
    assert free.text == wanted, "without choices the chain is followed"

    def act(choices, sampling=None, key="k"):
        gen.submit(key, prompt, sampling or Sampling(), choices=choices)
        got = {}
        while key not in got:
            got.update(gen.poll())
        gen.release(key)
        return got[key].text

    listed = ["open drawer 3", "go to cabinet 1", "go to cabinet 12", "examine mug 2"]
    text = act(listed)
    assert text.startswith("Action: go to cabinet")
    assert parse_action(text) in listed, "the policy's 'go to' is kept, 'the' is not listed"
    assert parse_action(act(["open drawer 3", "go to the cabinet 1"])) == "go to the cabinet 1", \
        "a listed command the policy writes anyway is played as written"
    for i in range(8):
        assert parse_action(act(listed, Sampling(temperature=1.0), key=i)) in listed
    with pytest.raises(ValueError, match="empty choices"):
        gen.submit("k", prompt, Sampling(), choices=[])
