"""Tiny Hugging Face tokenizers and models built offline, shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

#: A Qwen/ChatML-style chat template.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe(texts: Sequence[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def chat_tokenizer(texts: Sequence[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Like Qwen's: a ChatML chat template, ``<|im_end|>`` ends a turn."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe(texts, vocab_size, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def plain_eos_tokenizer(texts: Sequence[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Like GPT-2's: no chat template; the EOS token ends a turn."""
    return PreTrainedTokenizerFast(tokenizer_object=bpe(texts, vocab_size, ["<|endoftext|>"]),
                                   eos_token="<|endoftext|>")


def save_tiny_qwen(folder: Path, texts: Sequence[str], vocab_size: int = 400) -> Path:
    """A tiny ``Qwen2ForCausalLM`` with a chat-template tokenizer, saved like a hub download."""
    fast = chat_tokenizer(texts, vocab_size)
    config = Qwen2Config(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder
