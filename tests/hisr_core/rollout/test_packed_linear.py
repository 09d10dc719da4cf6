"""Linear layers through packed oneDNN weights during CPU generation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hisr_core.rollout.cpu import packed_linear
from hisr_core.rollout.cpu.packed_linear import PackedLinears


def tiny_llama(seed=0):
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def model():
    m = tiny_llama()
    if not PackedLinears(m).enabled:
        pytest.skip("this torch build has no packed oneDNN linear layers")
    return m


def logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def test_packed_layers_give_the_models_own_logits_and_really_run_packed(model):
    packed = PackedLinears(model)
    # 7 per layer, and the head tied to the embedding.
    assert len(packed.layers) == 2 * 7 + 1
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = logits(model, ids)
        with packed.active():
            got = logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(packed._packed) == len(packed.layers)


def test_one_token_keeps_torchs_linear(model):
    packed = PackedLinears(model)
    with torch.inference_mode(), packed.active():
        logits(model, torch.tensor([[5]]))
    assert packed._packed == {}
    assert packed_linear.MIN_TOKENS > 1


def test_a_weight_changed_in_place_is_packed_again(model):
    packed = PackedLinears(model)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), packed.active():
        before = logits(model, ids)
    with torch.no_grad():  # as an optimizer step does
        for p in model.parameters():
            p.mul_(1.5)
    with torch.inference_mode():
        want = logits(model, ids)
        with packed.active():
            got = logits(model, ids)
    assert not torch.allclose(before, want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_training_inside_the_block_keeps_autograd(model):
    packed = PackedLinears(model)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with packed.active():
        logits(model, ids).logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_the_layers_are_left_as_they_were(model):
    packed = PackedLinears(model)
    with pytest.raises(KeyError), packed.active():
        raise KeyError("a failure inside the block")
    assert all("forward" not in layer.__dict__ for layer in packed.layers)


def test_layers_it_cannot_serve_are_left_out():
    m = tiny_llama().to(torch.bfloat16)
    packed = PackedLinears(m)
    assert packed.layers == [] and not packed.enabled
