"""Hindsight examples (the hindsight block, the window, the target) and their batched
scoring against a one-example-at-a-time reference."""

from __future__ import annotations

import math

import pytest
import torch

from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import HindsightParams, LoraParams
from hisr_core.envs import environment_class
from hisr_core.rewards.gated_attention import (
    GATES_FILE,
    BlockPointer,
    attach_gates,
    block_inputs,
    block_span,
    forward_kwargs,
    gate_values,
    load_gated,
    save_gates,
)
from hisr_core.rewards.hindsight import (
    Window,
    closed_gate_logprobs,
    episode_features,
    fit_pointer,
    hindsight_example,
    hindsight_logprobs,
    outcome_line,
    told_by_future,
    told_nll,
    told_turns,
    trajectory_examples,
)
from hisr_core.train.engine import apply_lora, freeze_weights, lm_parts, param_groups
from hisr_core.train.scoring import episode_of, masked_logprobs, turn_logprobs
from hisr_core.train.sft import train_sft
from tests.hisr_core.train.sft_worker import train_hindsight
from tests.hisr_core.train.test_sft import HAS_DEEPSPEED, STEPS, run_worker
from tests.household_data import rollout_rows

GRAMMAR = environment_class("household").command_grammar


@pytest.fixture(scope="module")
def rows():
    return rollout_rows(6)


@pytest.fixture(scope="module")
def tiny_dir(rows, tmp_path_factory):
    texts = [t[k] for r in rows for t in r["turns"] for k in ("observation", "response")]
    return build_builtin("builtin:tiny", texts, 0, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


def _context(tokenizer, enc) -> str:
    """The decoded example before its target."""
    return tokenizer.decode(enc.input_ids[:enc.response_mask.index(1)])


def test_the_example_is_the_policy_sequence_after_a_system_text_with_the_future(rows, tokenizer):
    builder = PromptBuilder(tokenizer, None, 4096)
    row = rows[1]
    system, turns = episode_of(builder, row, GRAMMAR)
    k = 2
    enc = hindsight_example(builder, system, turns, k, row["outcome"], row["won"],
                            row["final_observation"])
    context = _context(tokenizer, enc)
    # After the system message the example is the policy's own sequence up to a_k, token for
    # token, so the target's nearby context is exactly pi_ref's...
    policy = builder.encode(system, turns[:k + 1], train_from=k)
    tail = len(policy.input_ids) - len(builder._system(system))
    assert enc.input_ids[-tail:] == policy.input_ids[-tail:]
    assert enc.response_mask[-tail:] == policy.response_mask[-tail:]
    # ...and the system message holds the task text, then the block: the later turns in order,
    # the outcome and the final observation.
    head = tokenizer.decode(enc.input_ids[:len(enc.input_ids) - tail])
    assert system in head and head.index(system) < head.index("Hindsight:")
    block = head[head.index("Hindsight:"):]
    later = [block.index(f"[Response] {resp}") for _, resp in turns[k + 1:]]
    assert later == sorted(later) and len(later) == len(turns) - k - 1
    assert "Outcome: success (R = 1.00)" in block and row["final_observation"] in block
    # a_k is nowhere before the target, and the masked tokens are a_k and its end-of-turn marker.
    assert turns[k][1] not in context
    target = builder._ids(turns[k][1]) + builder._asst_end
    assert [t for t, m in zip(enc.input_ids, enc.response_mask, strict=True) if m] == target
    assert enc.turn_ids[enc.response_mask.index(1)] == k


def _context_turns(tokenizer, enc, turns) -> list[int]:
    """Turns whose (unique) response is in the example before its target."""
    context = _context(tokenizer, enc)
    return [j for j, (_, resp) in enumerate(turns) if resp in context]


def test_the_window_keeps_the_policy_past_and_the_block_its_own_budget(rows, tokenizer):
    row = max(rows, key=lambda r: r["n_turns"])
    system, turns = episode_of(PromptBuilder(tokenizer), row, GRAMMAR)
    assert len({resp for _, resp in turns}) == len(turns)
    m, k = len(turns), 3

    def example(max_tokens, window=None):
        return hindsight_example(PromptBuilder(tokenizer, None, max_tokens), system, turns, k,
                                 row["outcome"], row["won"], row["final_observation"],
                                 window or Window())

    assert _context_turns(tokenizer, example(4096, Window(1, 1)), turns) == [k - 1, k + 1]
    assert _context_turns(tokenizer, example(4096, Window(None, 1)), turns) == \
        [j for j in range(k + 2) if j != k]
    full = example(4096)
    assert _context_turns(tokenizer, full, turns) == [j for j in range(m) if j != k]
    n_block = full.block[1] - full.block[0]
    n_prompt = len(PromptBuilder(tokenizer).prompt(system, turns[:k], turns[k][0]).input_ids)
    # Tighter budgets: the past is what the policy's prompt kept, whatever the block's size;
    # the block keeps the earliest later turns that fit in half of max_tokens.
    for max_tokens in (2 * n_block - 2, n_prompt - 1):
        enc = example(max_tokens)
        policy = PromptBuilder(tokenizer, None, max_tokens).prompt(system, turns[:k], turns[k][0])
        kept = _context_turns(tokenizer, enc, turns)
        assert [j for j in kept if j < k] == [j for j in policy.turns if j < k]
        later = [j for j in kept if j > k]
        assert later == list(range(k + 1, k + 1 + len(later))) and len(later) < m - 1 - k
        assert enc.block[1] - enc.block[0] <= max_tokens // 2
    assert [j for j in _context_turns(tokenizer, example(n_prompt - 1), turns) if j < k] != \
        list(range(k)), "the tighter budget drops past turns"
    with pytest.raises(ValueError, match="exceeds max_tokens|without later turns"):
        example(60)


def gated(tiny_dir, gate: float, reader_rank: int = 0, pointer_rank: int = 0):
    """The tiny model with gates, block readers whose residuals are not zero, and a pointer as
    it starts."""
    model = load_model(tiny_dir).eval()
    attach_gates(model, gate, reader_rank=reader_rank, pointer_rank=pointer_rank)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if ".hind_reader." in name:
            torch.nn.init.normal_(p, std=0.5)
    return model


def test_block_span_and_positions():
    assert block_span([1, 2, 3, 4], [1, 2, 9, 9, 3, 4]) == (2, 4)
    assert block_span([1, 2], [1, 2, 7]) == (2, 3)
    assert block_span([5, 5], [5, 5, 5]) == (2, 3)  # ambiguous repeats: the longest prefix
    with pytest.raises(ValueError, match="one insertion"):
        block_span([1, 2, 3], [1, 9, 3, 9])
    positions, block = block_inputs([(1, 3, 1), (1, 3, 2), (6, 6, 6)], 6)
    # Row 0: token 0, block tokens 1-2 at 1, 2, then tokens 3.. continue from 1 as if the
    # block were absent. Row 1: the same block placed at 2, 3. Row 2 has no block: 0..5.
    assert positions.tolist() == [[0, 1, 2, 1, 2, 3], [0, 2, 3, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert block.tolist() == [[False, True, True, False, False, False]] * 2 + [[False] * 6]


def test_the_pointer_boosts_the_block_tokens_it_attends_to():
    """Hand-derived. Tokens 0-1 are the block (ids 2, 3); W_q = 0 gives every block key score
    0, as the null slot's logit 0, so each later token attends 1/3 to each block token and 1/3
    to nothing: c = 1/3 at ids 2 and 3. With s = 3 and w = 0, logits' = logits + 1 at ids 2
    and 3; the block's own rows and a row without a block keep their logits. With s = 0 and
    w set, the boost is w . u with u = (W_v h_0 + W_v h_1) / 3."""
    pointer = BlockPointer(hidden=4, rank=2, seed=0)
    hidden, logits = torch.randn(2, 4, 4), torch.randn(2, 4, 5)
    ids = torch.tensor([[2, 3, 1, 2], [2, 3, 1, 2]])
    block = torch.tensor([[True, True, False, False], [False] * 4])
    with torch.no_grad():
        assert torch.equal(pointer(logits, hidden, ids, block), logits)  # starts as no change
        pointer.query.weight.zero_()
        pointer.scale.fill_(3.0)
        want = logits.clone()
        want[0, 2:, 2:4] += 1.0
        assert torch.allclose(pointer(logits, hidden, ids, block), want, atol=1e-6)
        pointer.scale.zero_()
        pointer.to_scale.copy_(torch.tensor([0.5, -0.25]))
        boost = pointer.value(hidden[0, :2]).sum(0) / 3 @ pointer.to_scale
        want = logits.clone()
        want[0, 2:, 2:4] += boost / 3
        got = pointer(logits, hidden, ids, block)
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize(("block_at", "max_tokens"),
                         [("system", 4096), ("turn", 4096), ("turn", 600)])
def test_closed_gates_are_exactly_pi_ref_and_open_ones_read_the_block(rows, tiny_dir, tokenizer,
                                                                      block_at, max_tokens):
    """Also when the policy's prompts drop old turns (max_tokens 600)."""
    builder = PromptBuilder(tokenizer, None, max_tokens)
    episodes = [episode_of(builder, r, GRAMMAR) for r in rows]
    dropped = any(builder.prompt(system, turns[:k], turns[k][0]).turns[0] > 0
                  for system, turns in episodes for k in range(len(turns)))
    assert dropped == (max_tokens < 4096)
    policy = turn_logprobs(load_model(tiny_dir).eval(), builder, episodes)
    window = Window(None, 2, block_at)
    # Block readers change only the block's own hidden states: closed gates hide them.
    # A pointer starts as no change.
    closed = hindsight_logprobs(gated(tiny_dir, -1e4, reader_rank=4, pointer_rank=4), builder,
                                rows, GRAMMAR, window)
    opened = hindsight_logprobs(gated(tiny_dir, 0.0), builder, rows, GRAMMAR, window)
    flat = [torch.cat([x for turns in ep for x in turns]) for ep in (policy, closed, opened)]
    assert torch.allclose(flat[1], flat[0], atol=1e-5, rtol=0)
    assert float((flat[2] - flat[0]).abs().max()) > 1e-3


@pytest.mark.parametrize("window", [Window(), Window(1, 2, "turn")],
                         ids=["all", "past-1-future-2-at-turn"])
def test_batched_hindsight_scores_equal_one_at_a_time(rows, tiny_dir, tokenizer, window):
    model = gated(tiny_dir, -1.0, pointer_rank=4)
    with torch.no_grad():  # a pointer that changes the logits: padding must not reach it
        model.hind_pointer.scale.fill_(2.0)
        model.hind_pointer.to_scale.fill_(0.1)
    builder = PromptBuilder(tokenizer, None, 4096)
    batched = hindsight_logprobs(model, builder, rows, GRAMMAR, window, max_batch_tokens=900)
    policy = turn_logprobs(model, builder, [episode_of(builder, r, GRAMMAR) for r in rows])
    for row, got, pol in zip(rows, batched, policy, strict=True):
        assert [len(x) for x in got] == [len(x) for x in pol]
        for k, enc in enumerate(trajectory_examples(builder, row, GRAMMAR, window)):
            extra = forward_kwargs([enc.block], len(enc.input_ids), torch.device("cpu"))
            with torch.inference_mode():
                logits = model(torch.tensor([enc.input_ids]), **extra).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1).gather(
                -1, torch.tensor(enc.input_ids[1:])[:, None]).squeeze(-1)
            want = logp[torch.tensor(enc.response_mask[1:], dtype=torch.bool)]
            assert torch.allclose(got[k], want, atol=1e-5, rtol=0)


# -- hindsight.reads: episode ------------------------------------------------------------------
def test_episode_features_key_the_later_turns_and_the_outcome_line(rows, tiny_dir, tokenizer):
    builder = PromptBuilder(tokenizer, None, 4096)
    model = gated(tiny_dir, -30.0, pointer_rank=4)
    backbone, _ = lm_parts(model, hooked=True)
    row = rows[0]
    [feats] = episode_features(backbone, builder, [row], GRAMMAR, 0)
    turns, m = row["turns"], row["n_turns"]
    assert feats.turns == m
    line = outcome_line(float(row["outcome"]), bool(row["won"]), row["final_observation"])
    for k in (0, m - 2, m - 1):
        queries, targets, keys, key_ids = feats.turn(k, 1)
        # The targets are response k as the policy generated it (text, end marker).
        assert targets.tolist() == builder._ids(turns[k]["response"]) + builder._asst_end
        assert queries.shape == (len(targets), model.config.hidden_size)
        text = tokenizer.decode(key_ids.tolist())
        assert text.endswith(line) and len(keys) == len(key_ids)
        if k + 1 < m:  # turn k+1 alone: its observation and response, as the episode had them
            later = text[:-len(line)]
            assert turns[k + 1]["observation"] in later and turns[k + 1]["response"] in later
            assert later.count("<|user|>") == 1
        else:
            assert text == line
    # future None: every later turn; 0: the outcome line alone.
    assert tokenizer.decode(feats.turn(0, None)[3].tolist()).count("<|user|>") == m - 1
    assert tokenizer.decode(feats.turn(0, 0)[3].tolist()) == line
    with pytest.raises(ValueError, match="outside an episode"):
        feats.turn(m, 1)


def test_reading_the_episode_with_a_silent_copy_head_is_pi_ref(rows, tiny_dir, tokenizer):
    builder = PromptBuilder(tokenizer, None, 600)  # prompts that drop old turns too
    policy = turn_logprobs(load_model(tiny_dir).eval(), builder,
                           [episode_of(builder, r, GRAMMAR) for r in rows])
    silent = hindsight_logprobs(gated(tiny_dir, -30.0, pointer_rank=4), builder, rows, GRAMMAR,
                                Window(None, 2, reads="episode"), max_batch_tokens=900)
    assert [[len(x) for x in ep] for ep in silent] == [[len(x) for x in ep] for ep in policy]
    assert all(torch.allclose(x, y, atol=1e-5, rtol=0)
               for ep_a, ep_b in zip(silent, policy, strict=True)
               for x, y in zip(ep_a, ep_b, strict=True))


def test_the_copy_head_alone_learns_to_read_the_episode(rows, tiny_dir, tokenizer, tmp_path):
    builder = PromptBuilder(tokenizer, None, 4096)
    model = gated(tiny_dir, -30.0, pointer_rank=4)
    backbone, head = lm_parts(model, hooked=True)
    pointer = model.hind_pointer
    weights = {n: p.detach().clone() for n, p in model.named_parameters()
               if not n.startswith("hind_pointer.")}
    before = {n: p.detach().clone() for n, p in pointer.named_parameters()}
    feats = episode_features(backbone, builder, rows[:4], GRAMMAR, 0)
    window = Window(None, 2, reads="episode")
    start = hindsight_logprobs(model, builder, rows[:4], GRAMMAR, window)
    logs = []
    cfg = HindsightParams(epochs=20.0, micro_batch_size=4, grad_accum=1, log_every=5,
                          pointer_rank=4, pointer_lr=0.01)
    stats = fit_pointer(pointer, head, feats, cfg, lambda step, m: logs.append(step))
    assert stats["examples"] == sum(r["n_turns"] for r in rows[:4])
    assert stats["steps"] == math.ceil(20 * stats["examples"] / 4) and logs[-1] == stats["steps"]
    assert all(not torch.equal(p, before[n]) for n, p in pointer.named_parameters())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()
               if n in weights)
    trained = hindsight_logprobs(model, builder, rows[:4], GRAMMAR, window)

    def nll(logps):
        return -float(torch.cat([x for ep in logps for x in ep]).mean())

    assert nll(trained) < nll(start) - 0.1
    # Saved and loaded, it scores the same; the params must say the route it was trained for.
    save_gates(model, tmp_path, "episode")
    model.save_pretrained(tmp_path)
    loaded = load_gated(tmp_path).eval()
    again = hindsight_logprobs(loaded, builder, rows[:4], GRAMMAR, window)
    assert all(torch.allclose(x, y, atol=1e-6) for ea, eb in zip(trained, again)
               for x, y in zip(ea, eb))
    with pytest.raises(ValueError, match="trained with hindsight.reads: episode.*rerun"):
        hindsight_logprobs(loaded, builder, rows[:1], GRAMMAR, Window(None, 2))


def test_a_gate_at_minus_30_is_closed_even_for_large_attention_logits(rows, tiny_dir, tokenizer):
    """Queries and keys scaled ×30 give attention logits far beyond 30: a −30 gate added as it
    is would let the block through; closed, the targets score exactly as ``pi_ref``'s. A −19
    gate is open."""
    builder = PromptBuilder(tokenizer, None, 4096)
    window = Window(None, 2, "turn")
    scores = {}
    for gate in (-30.0, -19.0, None):
        model = load_model(tiny_dir).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(30.0)
        if gate is None:
            got = turn_logprobs(model, builder, [episode_of(builder, r, GRAMMAR) for r in rows])
        else:
            attach_gates(model, gate)
            got = hindsight_logprobs(model, builder, rows, GRAMMAR, window, route="full")
        scores[gate] = torch.cat([x for ep in got for x in ep])
    assert torch.allclose(scores[-30.0], scores[None], atol=1e-5, rtol=0)
    assert float((scores[-19.0] - scores[None]).abs().max()) > 1e-3


@pytest.mark.parametrize(("window", "max_tokens", "reader_rank"),
                         [(Window(None, 2, "turn"), 4096, 0), (Window(None, 2, "turn"), 600, 4),
                          (Window(1, 2, "turn"), 4096, 4), (Window(None, None, "system"), 600, 0)],
                         ids=["future-2-at-turn", "dropped-turns-readers", "past-1-readers",
                              "all-at-system-dropped-turns"])
def test_closed_gates_score_from_the_plain_pass_and_the_block_pass_as_the_full_examples_do(
        rows, tiny_dir, tokenizer, window, max_tokens, reader_rank, monkeypatch):
    """The closed-gate route (one pass over each episode without blocks, one over each block
    after its cached prefix, then the copy head) gives the numbers of scoring every turn's
    whole example, with readers that change the blocks and a pointer that reads them."""
    from hisr_core.rewards import hindsight

    model = gated(tiny_dir, -30.0, reader_rank=reader_rank, pointer_rank=4)
    with torch.no_grad():
        model.hind_pointer.scale.fill_(2.0)
        model.hind_pointer.to_scale.fill_(0.1)
    builder = PromptBuilder(tokenizer, None, max_tokens)
    calls = []
    monkeypatch.setattr(hindsight, "closed_gate_logprobs",
                        lambda *a, **k: calls.append(1) or closed_gate_logprobs(*a, **k))
    monkeypatch.setattr(hindsight, "CLOSED_CHUNK", 4)  # 6 rows: two chunks
    auto = hindsight_logprobs(model, builder, rows, GRAMMAR, window, max_batch_tokens=900)
    full = hindsight_logprobs(model, builder, rows, GRAMMAR, window, max_batch_tokens=900,
                              route="full")
    assert calls == [1, 1]
    plain = turn_logprobs(model, builder, [episode_of(builder, r, GRAMMAR) for r in rows])
    for got, want, pol in zip(auto, full, plain, strict=True):
        assert [len(x) for x in got] == [len(x) for x in want]
        assert torch.allclose(torch.cat(got), torch.cat(want), atol=1e-5, rtol=0)
        assert float((torch.cat(got) - torch.cat(pol)).abs().max()) > 1e-3  # the pointer acts
    model_open = gated(tiny_dir, -1.0, pointer_rank=4)
    hindsight_logprobs(model_open, builder, rows[:1], GRAMMAR, window)
    hindsight_logprobs(load_model(tiny_dir).eval(), builder, rows[:1], GRAMMAR, window)
    assert calls == [1, 1]  # an open gate, or none, takes the full route


def test_masked_logprobs_rejects_a_target_without_context(tokenizer, tiny_dir):
    builder = PromptBuilder(tokenizer, None, 4096)
    enc = builder.encode("sys", [("obs", "resp")])
    bad = type(enc)(enc.input_ids, [1] * len(enc.input_ids), enc.turn_ids, enc.turns)
    with pytest.raises(ValueError, match="position 0"):
        masked_logprobs(load_model(tiny_dir), [bad], 0)


@pytest.mark.parametrize("lr", [1e-3, 0.0], ids=["weights-train", "weights-frozen"])
def test_hindsight_training_smoke(rows, tiny_dir, tokenizer, tmp_path, lr):
    builder = PromptBuilder(tokenizer, None, 4096)
    examples = [e for r in rows for e in trajectory_examples(builder, r, GRAMMAR, Window(2, 2))]
    assert len(examples) == sum(r["n_turns"] for r in rows)
    logs = []
    # Gates that open and train (params.yaml keeps them closed), one micro-batch a step.
    params = HindsightParams(reads="block", backend="torch", max_steps=2, log_every=1, micro_batch_size=4,
                             grad_accum=1, epochs=0.5, lr=lr, gate_init=-4.0, gate_lr=0.1,
                             reader_rank=4, pointer_rank=4)
    model = load_model(tiny_dir)
    attach_gates(model, params.gate_init, params.gate_lr, params.reader_rank, params.reader_lr,
                 params.seed, params.pointer_rank, params.pointer_lr)
    if lr == 0:
        freeze_weights(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = tmp_path / "pi_hind"
    train_sft(model, tokenizer, examples, params, "float32", lambda s, m: logs.append(m),
              progress=False, name="hindsight", out_dir=out,
              extra=lambda folder: save_gates(model, folder))
    assert [math.isfinite(m["losses/hindsight"]) for m in logs] == [True, True]
    # Every gate, reader and pointer parameter moved (the gates by about gate_lr a step:
    # Adam); the weights moved unless frozen. (A reader's down-projection, and the pointer's
    # attention, move from step 2, once what multiplies them is not 0.)
    own = {n for n in before if n.endswith("hind_gate") or ".hind_reader." in n
           or n.startswith("hind_pointer.")}
    assert len(own) == 3 * len(gate_values(model)) + 6
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == (set(before) if lr else own)
    assert (gate_values(model) != params.gate_init).all()
    # The folder holds a plain model plus the gates and readers; load_gated restores them.
    from safetensors.torch import load_file
    saved = load_file(str(out / "model.safetensors"))
    assert not [k for k in saved if k.endswith("hind_gate") or "hind_" in k]
    loaded = load_gated(out).eval()
    assert torch.equal(gate_values(loaded), gate_values(model))
    model.eval()
    builder4 = PromptBuilder(tokenizer, None, 4096)
    a = hindsight_logprobs(model, builder4, rows[:2], GRAMMAR, Window(2, 2))
    b = hindsight_logprobs(loaded, builder4, rows[:2], GRAMMAR, Window(2, 2))
    assert all(torch.allclose(x, y, atol=1e-6) for ea, eb in zip(a, b) for x, y in zip(ea, eb))
    with pytest.raises(FileNotFoundError, match=GATES_FILE):
        load_gated(tiny_dir)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (extra gpu)")
def test_frozen_weights_under_deepspeed_train_the_block_parameters_as_torch_does(tiny_dir,
                                                                                  tmp_path):
    """The stage's default on a GPU: DeepSpeed (one CPU process here, gloo, ZeRO-2) with only
    the gates, readers and pointer trainable: the same curve and trained values as plain torch, and
    nothing else moves."""
    ds = run_worker(tmp_path, tiny_dir, "deepspeed", 4, 1, extra=("--hindsight",))
    ref = train_hindsight(tiny_dir, "torch", 4, STEPS)
    assert ds["moved"] == ref["moved"]
    assert ds["moved"] and all(n.endswith("hind_gate") or ".hind_reader." in n
                               or n.startswith("hind_pointer.") for n in ds["moved"])
    assert any(n.startswith("hind_pointer.") for n in ds["moved"])
    for key in ("losses", "grad_norms"):
        assert ds[key] == pytest.approx(ref[key], rel=1e-4), key
    for name in ds["moved"]:
        assert ds["values"][name] == pytest.approx(ref["values"][name], rel=1e-4, abs=1e-6), name


def test_block_readers_start_from_the_seed_not_the_global_rng(tiny_dir):
    def readers(seed: int) -> dict[str, torch.Tensor]:
        model = load_model(tiny_dir)
        torch.rand(7)  # the global RNG moves on between the two
        attach_gates(model, -4.0, reader_rank=4, seed=seed)
        return {n: p for n, p in model.named_parameters() if ".hind_reader.down" in n}

    a, b, c = readers(0), readers(0), readers(1)
    assert len(a) == load_model(tiny_dir).config.num_hidden_layers
    assert all(torch.equal(a[n], b[n]) and not torch.equal(a[n], c[n]) for n in a)


def test_gates_keep_their_learning_rate_and_train_under_lora(tiny_dir):
    model = load_model(tiny_dir)
    gates = attach_gates(model, -8.0, lr=0.05)
    wrapped = apply_lora(model, LoraParams(enabled=True, r=2, alpha=4))
    assert all(g.requires_grad for g in gates)
    groups = param_groups(wrapped, 0.01)
    assert sorted(g["lr"] for g in groups if "lr" in g) == [0.05] * len(gates)


def test_a_block_at_turn_k_takes_the_positions_just_before_it(rows, tokenizer):
    builder = PromptBuilder(tokenizer, None, 4096)
    at_system = trajectory_examples(builder, rows[0], GRAMMAR, Window(None, 2))
    at_turn = trajectory_examples(builder, rows[0], GRAMMAR, Window(None, 2, "turn"))
    for k, (plain, moved) in enumerate(zip(at_system, at_turn, strict=True)):
        start, end, at = moved.block
        assert plain.block == (start, end, start)
        # Turn k's first token is at index i with the block, at position i - n without it.
        n = end - start
        assert at == max(0, moved.turn_ids.index(k) - n - n)


def test_a_turn_is_told_by_its_future_when_the_next_observation_names_what_it_acts_on():
    assert told_by_future("take bowl 1 from cabinet 1", "You pick up the bowl 1 from the cabinet 1.")
    assert told_by_future("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed.")
    assert not told_by_future("take mug 3 from table 1", "Nothing happens.")
    assert not told_by_future("go to cabinet 1", "You arrive at cabinet 10.")  # not cabinet 1
    assert not told_by_future("inventory", "You are carrying: a bowl 1.")  # names nothing
    row = {"turns": [{"action": "go to shelf 2", "observation": "start"},
                     {"action": "take cup 1 from shelf 2", "observation": "You arrive at shelf 2."}],
           "final_observation": "Nothing happens."}
    assert told_turns(row) == [True, False]


def test_told_nll_by_hand():
    """Trajectory A: a told turn (NLL 1, 1 under pi_hind; 2, 2 under pi_ref) and an untold one
    (2 and 2); B: a told turn (0.5 and 0.5). Told: pi_hind (2 + 0.5) / 3, pi_ref (4 + 0.5) / 3,
    delta -2/3; untold: 2 and 2, delta 0."""
    t = torch.tensor
    got = told_nll([[True, False], [True]],
                   [[t([-1.0, -1.0]), t([-2.0])], [t([-0.5])]],
                   [[t([-2.0, -2.0]), t([-2.0])], [t([-0.5])]], n_boot=200)
    assert got["told/turns"] == 2 and got["told/tokens"] == 3
    assert got["told/nll_hind"] == pytest.approx(2.5 / 3)
    assert got["told/nll_ref"] == pytest.approx(4.5 / 3)
    assert got["told/delta"] == pytest.approx(-2 / 3)
    assert got["told/delta_low"] <= -2 / 3 + 1e-9 and got["told/delta_high"] <= 0
    assert (got["untold/turns"], got["untold/tokens"], got["untold/delta"]) == (1, 1, 0.0)
    assert got["untold/nll_hind"] == got["untold/nll_ref"] == 2.0
