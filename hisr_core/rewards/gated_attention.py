"""Gated attention to an inserted block of tokens: how ``pi_hind`` reads the hindsight block
while starting exactly from ``pi_ref`` (docs/method.md stage 5; see :mod:`hisr_core.rewards.hindsight`).

A hindsight example is ``pi_ref``'s own sequence for turn k with a block of tokens (the later
turns and the outcome) inserted into the system message. Inserted as plain text, the block
changes what every later token attends to *and* its position, so the target's relative
distances to its whole context shift (RoPE) and ``pi_ref`` starts far worse than from the prefix
alone. Here instead:

* positions: every token outside the block keeps the position it has without the block; block
  token i sits at ``at + i`` (where it is, or just before the target's turn: overlapping other
  tokens, which RoPE tolerates, as only relative distances matter);
* attention: each layer l and query head h adds a learned gate ``g[l, h]`` to the attention
  logits from every token outside the block to every block token (the block reads itself,
  causally, as plain text). A closed gate (``g <= CLOSED_GATE``, applied as ``SHUT``) is
  exactly ``pi_ref`` on the tokens outside the block; training opens the gates (and may tune
  the weights) as far as the block helps.

The gate rides in the causal fast path of SDPA as one extra query/key channel:
``q' = [q, (1 - block_q) / scale]``, ``k' = [k, g * block_k]``, so
``scale * q'.k' = scale * q.k + g * (1 - block_q) * block_k``. The gates are a parameter
``hind_gate`` of shape (heads,) on every attention module.

A block reader (optional, ``reader_rank > 0``) lets the block's own representation learn while
every other token is computed by ``pi_ref``'s weights: each decoder layer adds a low-rank
residual ``B(A h)`` (``B`` zero at the start) to the hidden states of block tokens only, so the
block can become what the frozen queries of the other tokens look for. With the weights frozen,
``pi_hind`` differs from ``pi_ref`` only through what the gates let through.

A copy head (optional, ``pointer_rank > 0``, :class:`BlockPointer`) reads the block on the
logits instead: each position outside the block points at block tokens and adds a learned
boost to their ids (zero at the start). It needs no query of ``pi_ref``'s to look at the block,
so it works with the gates closed; the model's forward applies it (hooks), and
:func:`~hisr_core.train.engine.lm_parts` then leaves the LM head to that forward.

:func:`save_gates` writes the gates, readers and copy head beside the Hugging Face folder (the
weights file holds the plain model) and :func:`load_gated` restores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hisr_core.train.engine import LOGITS_HOOKED, OWN_LR, unwrap_hf

ATTN_IMPLEMENTATION = "hisr_gated_sdpa"
GATES_FILE = "hindsight_gates.safetensors"
GATE_PARAM = "hind_gate"
READER = "hind_reader"
POINTER = "hind_pointer"
#: Attribute of a model :func:`load_gated` returns: the ``hindsight.reads`` it was trained for.
READS = "hisr_hind_reads"
#: A gate at or below this is closed: applied as :data:`SHUT`, so no token outside the block
#: reads it at all. (A gate of -30 taken as it is still lets a query whose logit towards a
#: block key is 30 above its others read the block: trained attention logits get there.)
CLOSED_GATE = -20.0
SHUT = -1e4


# -- the block and its positions -------------------------------------------------------------------
def block_span(plain: Sequence[int], with_block: Sequence[int]) -> tuple[int, int]:
    """``[start, end)`` of the tokens ``with_block`` inserts into ``plain``: the longest common
    prefix and suffix, so that ``with_block`` without its span is exactly ``plain``."""
    if len(with_block) < len(plain):
        raise ValueError("the sequence with the block is shorter than the plain one")
    start = 0
    while start < len(plain) and plain[start] == with_block[start]:
        start += 1
    tail = 0
    while tail < len(plain) - start and plain[-1 - tail] == with_block[-1 - tail]:
        tail += 1
    if start + tail != len(plain):
        raise ValueError("the sequence with the block is not the plain one with one insertion")
    return start, len(with_block) - tail


def block_inputs(spans: Sequence[tuple[int, int, int]], width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and block mask of right-padded rows with one block ``(start, end, at)``
    each: tokens ``start..end-1`` are the block, block token i sits at position ``at + i``.

    Shape: B spans, ``width`` T → position_ids [B, T] long, block [B, T] bool. Outside the block
    a token's position counts the non-block tokens before it. Padding continues the count (it
    is never scored).
    """
    idx = torch.arange(width)[None, :]
    start, end, at = (torch.tensor([s[j] for s in spans])[:, None] for j in range(3))
    block = (idx >= start) & (idx < end)
    return torch.where(block, at + idx - start, torch.cumsum(~block, dim=1) - 1), block


# -- the attention function ------------------------------------------------------------------------
def gated_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, is_causal: bool | None = None,
               hind_block: torch.Tensor | None = None, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, plus ``g[h]`` on the logits of block keys when the forward
    call passes ``hind_block`` ([B, T] bool). Shape: query [B, H, T, D], key and value
    [B, H_kv, T, D] → ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    # Queries inside the block read no gate: a pass of block tokens alone (after a cached
    # prefix, hisr_core.rewards.hindsight.closed_gate_logprobs) is plain attention.
    if hind_block is None or bool(hind_block.all()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if query.shape[2] != key.shape[2]:
        raise ValueError("gated attention scores whole sequences (no cache)")
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    gate = getattr(module, GATE_PARAM).to(query.dtype)
    gate = torch.where(gate <= CLOSED_GATE, gate.new_full((), SHUT), gate)
    b, h, t, d = query.shape
    # The gate channel, then zeros to a multiple of 8: an odd head width leaves SDPA's fused
    # kernel for the math one (~4x slower forward and backward on a CPU).
    pad = -(d + 1) % 8
    zeros = query.new_zeros((b, h, t, pad))
    # Only queries outside the block are gated: the block reads itself as plain text.
    q_gate = (~hind_block)[:, None, :, None].to(query.dtype).expand(b, h, t, 1) / scale
    k_gate = (gate[None, :, None, None] * hind_block[:, None, :, None].to(query.dtype)
              ).expand(b, h, t, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([query, q_gate, zeros], dim=-1), torch.cat([key, k_gate, zeros], dim=-1),
        torch.cat([value, value.new_zeros((b, h, t, pad + 1))], dim=-1),
        attn_mask=attention_mask, dropout_p=dropout, scale=scale,
        is_causal=attention_mask is None)
    return out[..., :value.shape[-1]].transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPLEMENTATION, gated_sdpa)
        # The same masks as SDPA: a padded batch without the block still gets its mask.
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


# -- gates on a model ------------------------------------------------------------------------------
def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a Hugging Face decoder, in layer order."""
    found = [m for m in unwrap_hf(model).modules()
             if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention modules with a layer index; "
                         "gated hindsight attention supports Hugging Face decoder models")
    return sorted(found, key=lambda m: m.layer_idx)


class BlockReader(nn.Module):
    """The low-rank residual a decoder layer adds to block tokens' hidden states.

    Shape: hidden [B, T, d], block [B, T] bool → [B, T, d] (unchanged outside the block)."""

    def __init__(self, hidden: int, rank: int, seed: int = 0) -> None:
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        # nn.Linear's own init, drawn from ``seed`` (not the global RNG): same seed, same pi_hind.
        nn.init.kaiming_uniform_(self.down.weight, a=5 ** 0.5,
                                 generator=torch.Generator().manual_seed(seed))
        nn.init.zeros_(self.up.weight)  # starts as no change: the block as pi_ref reads it

    def forward(self, hidden: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return hidden + block[..., None].to(hidden.dtype) * self.up(self.down(hidden))


class BlockPointer(nn.Module):
    """A copy head on the block: next-token logits outside the block, plus a boost for the
    block's tokens the position points at.

    Token t outside the block attends over the block's tokens and a null slot (its logit
    ``null``): ``a[t, j] = softmax_j((W_q h_t) . (W_k h_j) / sqrt(r))`` on the final hidden
    states (``pi_ref``'s reading of the block as plain text). With the copy distribution
    ``c[t, v] = sum_{j: x_j = v} a[t, j]`` and the summary ``u_t = sum_j a[t, j] W_v h_j``:

        logits'[t] = logits[t] + (s + w . u_t) * c[t]

    ``s`` and ``w`` start at zero, so the head starts as no change (``pi_ref``); training
    learns where the future shows the answer (the object or place the next observation
    names). Outside the block the hidden states are ``pi_ref``'s: the head adds no way to fit
    the responses except through what the block says.

    Shape: logits [B, T, V], hidden [B, T, d], ids [B, T] long, block [B, T] bool →
    [B, T, V] (unchanged on block tokens and in rows without a block)."""

    def __init__(self, hidden: int, rank: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.query, self.key, self.value = (nn.Linear(hidden, rank, bias=False) for _ in range(3))
        for lin in (self.query, self.key, self.value):
            nn.init.kaiming_uniform_(lin.weight, a=5 ** 0.5, generator=gen)
        # Shape (1,), not (): DeepSpeed broadcasts parameters as bytes, which a 0-d one cannot be.
        self.null = nn.Parameter(torch.zeros(1))
        self.scale = nn.Parameter(torch.zeros(1))
        self.to_scale = nn.Parameter(torch.zeros(rank))

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor,
                block: torch.Tensor) -> torch.Tensor:
        return self.point(logits, hidden, hidden, ids, block[:, None, :] & ~block[:, :, None])

    def point(self, logits: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor,
              key_ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The head on queries ``hidden`` over block tokens ``keys`` (their final hidden states
        and ids) that ``allowed`` lets each query see (none: no change).

        Shape: logits [B, T, V], hidden [B, T, d], keys [B, S, d], key_ids [B, S] long,
        allowed [B, T, S] bool → [B, T, V]."""
        b, t, s = allowed.shape
        q = self.query(hidden.to(self.query.weight.dtype))
        keys = keys.to(self.query.weight.dtype)
        scores = q @ self.key(keys).transpose(1, 2) / q.shape[-1] ** 0.5            # [B, T, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.softmax(torch.cat([scores, self.null.expand(b, t, 1)], dim=-1), dim=-1
                             )[..., :-1]
        boost = self.scale + (attn @ self.value(keys)) @ self.to_scale                # [B, T]
        # boost * c added in place of building c: no second [B, T, V] tensor (large vocabularies).
        return logits.float().scatter_add(2, key_ids[:, None, :].expand(b, t, s),
                                          boost[..., None] * attn).to(logits.dtype)


def _stash_hidden(backbone: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  output: Any) -> None:
    """Forward hook of the backbone: keep what the pointer needs for the LM's forward hook."""
    block = kwargs.get("hind_block")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if block is not None and ids is not None:
        backbone._hind_stash = (output.last_hidden_state, ids, block)


def _point(lm: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of the causal LM: its pointer on the logits of a call with a block."""
    backbone = lm.base_model
    stash = backbone.__dict__.pop("_hind_stash", None)
    if stash is None or output.logits.shape[:2] != stash[1].shape:
        return None
    output.logits = getattr(lm, POINTER)(output.logits, *stash)
    return output


def _read_block(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of a decoder layer: its reader on the input hidden states."""
    block = kwargs.get("hind_block")
    if block is None:
        return None
    if args:
        return (getattr(layer, READER)(args[0], block), *args[1:]), kwargs
    kwargs["hidden_states"] = getattr(layer, READER)(kwargs["hidden_states"], block)
    return args, kwargs


def attach_gates(model: nn.Module, init: float, lr: float | None = None, reader_rank: int = 0,
                 reader_lr: float | None = None, seed: int = 0, pointer_rank: int = 0,
                 pointer_lr: float | None = None) -> list[nn.Parameter]:
    """Give every attention layer of ``model`` a gate per query head (value ``init``) and switch
    it to gated attention, with ``reader_rank > 0`` every decoder layer a block reader of
    that rank (initialised from ``seed`` and the layer index), and with ``pointer_rank > 0``
    the LM a :class:`BlockPointer` of that rank; ``lr``, ``reader_lr`` and ``pointer_lr``: their
    own peak learning rates in training (:data:`~hisr_core.train.engine.OWN_LR`). Returns the
    gates, layer by layer."""
    _register()
    hf = unwrap_hf(model)
    heads = hf.config.get_text_config().num_attention_heads
    hidden = hf.config.get_text_config().hidden_size
    gates = []
    for m in attention_modules(hf):
        # A weight of the layer (not the float32 gate of an earlier call): device and dtype.
        param = next(p for n, p in m.named_parameters() if n != GATE_PARAM)
        if not hasattr(m, GATE_PARAM):
            m.register_parameter(GATE_PARAM, nn.Parameter(
                torch.full((heads,), float(init), dtype=torch.float32, device=param.device)))
        gates.append(getattr(m, GATE_PARAM))
        if lr == 0:  # the gates stay where they are (closed: the pointer alone reads the block)
            gates[-1].requires_grad_(False)
        else:
            setattr(gates[-1], OWN_LR, lr)
        if reader_rank > 0:
            layer = _layer_of(hf, m)
            if not hasattr(layer, READER):
                reader = BlockReader(hidden, reader_rank, seed * 1009 + m.layer_idx
                                     ).to(param.device, param.dtype)
                layer.add_module(READER, reader)
                layer.register_forward_pre_hook(_read_block, with_kwargs=True)
            for p in getattr(layer, READER).parameters():
                setattr(p, OWN_LR, reader_lr)
    if pointer_rank > 0:
        if not hasattr(hf, POINTER):
            param = next(hf.parameters())
            hf.add_module(POINTER, BlockPointer(hidden, pointer_rank, seed * 1009 + 1000003
                                                ).to(param.device, param.dtype))
            hf.base_model.register_forward_hook(_stash_hidden, with_kwargs=True)
            hf.register_forward_hook(_point, with_kwargs=True)
            setattr(hf, LOGITS_HOOKED, True)
        for p in getattr(hf, POINTER).parameters():
            setattr(p, OWN_LR, pointer_lr)
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    # The weights file stays a plain model; the gates, readers and pointer have a file of their
    # own.
    ignore = {name for name, _ in hf.named_parameters()
              if name.endswith("." + GATE_PARAM) or f".{READER}." in name
              or name.startswith(POINTER + ".")}
    hf._keys_to_ignore_on_save = set(hf._keys_to_ignore_on_save or ()) | ignore
    return gates


def _layer_of(hf: nn.Module, attention: nn.Module) -> nn.Module:
    """The decoder layer holding an attention module."""
    for layer in hf.modules():
        if any(child is attention for child in layer.children()):
            return layer
    raise ValueError(f"no decoder layer holds {type(attention).__name__} {attention.layer_idx}")


def _readers(model: nn.Module) -> list[BlockReader]:
    hf = unwrap_hf(model)
    found = [getattr(_layer_of(hf, m), READER, None) for m in attention_modules(hf)]
    return [r for r in found if r is not None]


def gates_closed(model: nn.Module) -> bool:
    """Whether no token outside the block reads it through attention (every layer gated, every
    gate at or below :data:`CLOSED_GATE`): then their hidden states are the model's own
    without the block. False for a model without gates (it reads the block as plain text)."""
    try:
        modules = attention_modules(model)
    except ValueError:
        return False
    gates = [getattr(m, GATE_PARAM, None) for m in modules]
    return all(g is not None for g in gates) and \
        max(float(g.detach().max()) for g in gates) <= CLOSED_GATE


def clear_pointer_stash(model: nn.Module) -> None:
    """Drop what a backbone call with a block left for the pointer's hook (a call of the
    backbone alone never reaches the LM's hook that would take it)."""
    unwrap_hf(model).base_model.__dict__.pop("_hind_stash", None)


def gate_values(model: nn.Module) -> torch.Tensor:
    """The gates of a gated model. Shape: [layers, heads]."""
    return torch.stack([getattr(m, GATE_PARAM).detach().float().cpu()
                        for m in attention_modules(model)])


def save_gates(model: nn.Module, folder: str | Path, reads: str = "block") -> None:
    """Write the gates (and block readers) into a model folder (next to the weights file);
    ``reads``: the ``hindsight.reads`` the model was trained for, kept as metadata."""
    from safetensors.torch import save_file

    tensors = {"gates": gate_values(model)}
    for i, reader in enumerate(_readers(model)):
        tensors[f"reader.{i}.down"] = reader.down.weight.detach().float().cpu().contiguous()
        tensors[f"reader.{i}.up"] = reader.up.weight.detach().float().cpu().contiguous()
    pointer = getattr(unwrap_hf(model), POINTER, None)
    if pointer is not None:
        tensors |= {f"pointer.{k}": v.detach().float().cpu().contiguous()
                    for k, v in pointer.state_dict().items()}
    save_file(tensors, str(Path(folder) / GATES_FILE), metadata={"reads": reads})


def load_gated(path: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """A gated model folder (written with :func:`save_gates`) with its gates and readers."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from hisr_core.agent.models import load_model

    gates_file = Path(path) / GATES_FILE
    if not gates_file.is_file():
        raise FileNotFoundError(f"{path} has no {GATES_FILE}: not a hindsight model folder "
                                "(rerun the hindsight stage)")
    saved = load_file(str(gates_file))
    with safe_open(str(gates_file), "pt") as f:
        reads = (f.metadata() or {}).get("reads", "block")
    values = saved["gates"]
    rank = saved["reader.0.down"].shape[0] if "reader.0.down" in saved else 0
    pointer = {k.removeprefix("pointer."): v for k, v in saved.items() if k.startswith("pointer.")}
    model = load_model(path, dtype=dtype)
    gates = attach_gates(model, 0.0, reader_rank=rank,
                         pointer_rank=pointer["query.weight"].shape[0] if pointer else 0)
    if values.shape != (len(gates), gates[0].numel()):
        raise ValueError(f"{gates_file}: gates of shape {tuple(values.shape)} do not fit a model "
                         f"of {len(gates)} layers × {gates[0].numel()} heads")
    with torch.no_grad():
        for gate, value in zip(gates, values, strict=True):
            gate.copy_(value)
        for i, reader in enumerate(_readers(model)):
            reader.down.weight.copy_(saved[f"reader.{i}.down"])
            reader.up.weight.copy_(saved[f"reader.{i}.up"])
    if pointer:
        getattr(model, POINTER).load_state_dict(pointer)
    setattr(model, READS, reads)
    return model


def forward_kwargs(spans: Sequence[tuple[int, int, int] | None], width: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The extra forward arguments of a right-padded batch whose rows may carry a block
    (``{}`` when none does). A row without one gets an empty span at its end."""
    if all(s is None for s in spans):
        return {}
    filled = [s if s is not None else (width, width, width) for s in spans]
    positions, block = block_inputs(filled, width)
    return {"position_ids": positions.to(device), "hind_block": block.to(device),
            # An explicit all-ones mask keeps transformers from reading the overlapping
            # positions as packed sequences; right padding needs no other mask (causal).
            "attention_mask": torch.ones_like(block, dtype=torch.long, device=device)}
