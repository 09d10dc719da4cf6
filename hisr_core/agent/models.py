"""Policy models: Hugging Face causal LMs, or the built-in Llama-architecture models.

``model.name_or_path`` is either a Hugging Face model (a local folder or a hub id; any
architecture ``AutoModelForCausalLM`` loads) or ``builtin:<size>``. A builtin model is created
from a config, with a byte-level BPE tokenizer trained on the project's own expert text, and
saved with ``save_pretrained`` so every later stage loads it like any Hugging Face model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the heavy imports wait until a model is built or loaded (fast CLI checks)
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BUILTIN_PREFIX = "builtin:"

#: Role markers of the plain prompt template. A builtin tokenizer has each as one special
#: token; for a Hugging Face tokenizer without a chat template they are ordinary text.
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
PAD, BOS = "<|pad|>", "<|bos|>"
SPECIAL_TOKENS = (PAD, BOS, END, SYSTEM, USER, ASSISTANT)


@dataclasses.dataclass(frozen=True)
class BuiltinSize:
    """Shape of a builtin Llama model; ``vocab_size`` is the BPE target size."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 4096


BUILTIN_SIZES: dict[str, BuiltinSize] = {
    # < 1M parameters: for tests. Head size 32: the smallest vLLM's CPU attention serves.
    "tiny": BuiltinSize(64, 176, 2, 2, 1, 512),
    # A few million parameters: the default, trained by SFT on a 2-core CPU in minutes.
    "small": BuiltinSize(256, 704, 4, 8, 4, 2048),
    # ``small`` with one KV head (multi-query attention): batched CPU decoding reads a quarter of
    # the KV cache, at a cost in policy quality (speed and success measured in CHANGELOG.md,
    # 2026-12-03).
    "small-mq": BuiltinSize(256, 704, 4, 8, 1, 2048),
    "base": BuiltinSize(512, 1408, 8, 8, 4, 4096),
}


def is_builtin(name_or_path: str) -> bool:
    return name_or_path.startswith(BUILTIN_PREFIX)


def builtin_size(name_or_path: str) -> BuiltinSize:
    size = name_or_path.removeprefix(BUILTIN_PREFIX)
    if size not in BUILTIN_SIZES:
        raise ValueError(f"unknown builtin model {name_or_path!r}; "
                         f"known: {[BUILTIN_PREFIX + s for s in BUILTIN_SIZES]}")
    return BUILTIN_SIZES[size]


def check_model_source(name_or_path: str) -> None:
    """Fail early (before any work) with a message naming ``model.name_or_path`` if it cannot
    be loaded: a builtin size that does not exist, a local path that is not a saved model
    folder, or a hub id that is not in the local cache while hub downloads are off."""
    if is_builtin(name_or_path):
        builtin_size(name_or_path)
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model.name_or_path {name_or_path!r}: folder has no config.json "
                             "(not a saved Hugging Face model)")
        return
    hub_id = len(Path(name_or_path).parts) <= 2 and not name_or_path.startswith((".", "/", "~"))
    if not hub_id:
        raise ValueError(f"model.name_or_path {name_or_path!r}: no such folder")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            raise ValueError(f"model.name_or_path {name_or_path!r}: no such folder, and not in "
                             "the local Hugging Face cache (hub downloads are off: HF_HUB_OFFLINE)")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, with the prompt role markers as special
    tokens (so they are never split and ``decode(..., skip_special_tokens=True)`` drops them).

    Byte-level pieces make decoding exact: any text round-trips, even words never seen.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        model_max_length=BUILTIN_SIZES["small"].max_position_embeddings,
        padding_side="left",
    )


def build_builtin(name: str, texts: Iterable[str], seed: int, out_dir: Path) -> Path:
    """Create ``builtin:<size>`` with a tokenizer trained on ``texts``; save it to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    size = builtin_size(name)
    tokenizer = train_tokenizer(texts, size.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        # Decoder-only models often ship without a pad token; padding is masked anyway.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(path: str | Path, dtype: torch.dtype | None = None, **kwargs: Any) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, **kwargs)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
