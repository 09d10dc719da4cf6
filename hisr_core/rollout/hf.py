"""The ``hf`` backend: continuous batching over one transformers model with a ragged KV cache.

Every row of the cache is one episode's context, kept between its turns; each pass decodes one
token for every generating row and packs new prompt tokens beside them (:class:`HFGenerator`).
Decode tokens read their rows through the compiled CPU kernel
(:mod:`hisr_core.rollout.cpu.decode_attention`) where it serves, through SDPA otherwise; both
compute in the query's dtype from the cache as stored, so they agree within float rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from hisr_core.agent.react import action_label_end
from hisr_core.rollout.cpu.decode_attention import attend, supported
from hisr_core.rollout.engine import Generation, Sampling, Streaming, key_seed

#: The attention :class:`HFGenerator` runs an SDPA model under, over its ragged KV cache (see
#: :func:`_ragged_sdpa`).
RAGGED_ATTENTION = "hisr_ragged_sdpa"



@dataclasses.dataclass
class _Plan:
    """How :func:`_ragged_sdpa` reads the cache in one forward pass.

    A decode pass has one token a row, rows ``0..span-1``, read by the compiled kernel
    (:mod:`hisr_core.rollout.cpu.decode_attention`), each row only to its own ``lengths``
    columns. A packed pass is one sequence: with the kernel, every token, decode or prompt,
    reads its row ``rows`` up to its own column (``lengths``) in one call; without, the
    decode tokens of the cache rows ``decode`` read rows ``0..span-1`` through SDPA, masked by
    ``decode_mask``, then each prompt ``(row, start, stop, mask)`` reads its own row.
    Shape: decode (n,), lengths (span,) or, packed, (N,) with ``rows`` (N,) (the pass's N
    tokens); decode_mask (span, 1, 1, W); a prompt's mask (1, 1, stop-start, L).
    """

    span: int = 0
    decode: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prompts: list[tuple[int, int, int, torch.Tensor]] = dataclasses.field(default_factory=list)
    lengths: torch.Tensor | None = None
    rows: torch.Tensor | None = None


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("ragged_plan", default=None)


def _ragged_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
                 ) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention as the forward pass's :class:`_Plan` says: a decode
    pass's tokens through the compiled kernel; a packed pass's decode tokens and prompts each
    over their own row. SDPA computes in the query's dtype, reading the cache's keys and values
    cast to it, as the kernel does: the same numbers whichever route runs.
    Shape: query [B, H, T, D], key and value [B, H_kv, S, D] → ([B, T, H, D], None); a packed
    pass: query [1, H, N, D], key and value every row's [rows, H_kv, S, D] → [1, N, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None
             ) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        if m is None:
            return sdpa_attention_forward(module, q, k, v, m, **kwargs)[0]
        # Grouped-query attention without copying each KV head for its query heads, as
        # transformers does for a masked query of several tokens.
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=m, scale=kwargs.get("scaling"), enable_gqa=True)
        return out.transpose(1, 2)

    def decode(q: torch.Tensor, rows: torch.Tensor | None, m: torch.Tensor | None
               ) -> torch.Tensor:
        """The token of each cache row in ``rows`` (None: rows ``0..n-1``; SDPA reads rows
        ``0..span-1`` to the longest, masked by ``m``). Shape: q (n, H, D) → (n, H, D)."""
        if plan.lengths is not None:
            picked = torch.arange(len(q)) if rows is None else rows
            scale = kwargs.get("scaling")
            return attend(q, key, value, picked, plan.lengths,
                          q.shape[-1] ** -0.5 if scale is None else scale)
        assert m is not None
        full = q if rows is None else q.new_zeros((plan.span, *q.shape[1:])).index_copy_(
            0, rows, q)
        w = m.shape[-1]
        out = sdpa(full[:, :, None], key[:plan.span, :, :w], value[:plan.span, :, :w], m)[:, 0]
        return out if rows is None else out[rows]

    plan = _PLAN.get()
    if plan is None or (plan.decode is None and query.shape[2] != 1):
        out = sdpa(query, key, value, attention_mask)
    elif plan.decode is None:
        out = decode(query[:, :, 0], None, None)[:, None]
    else:
        if plan.rows is not None:
            return decode(query[0].transpose(0, 1), plan.rows, None)[None], None
        n = len(plan.decode)
        parts = [decode(query[0, :, :n].transpose(0, 1), plan.decode, plan.decode_mask)] \
            if n else []
        for row, a, b, m in plan.prompts:
            length = m.shape[-1]
            parts.append(sdpa(query[:, :, a:b], key[row:row + 1, :, :length],
                              value[row:row + 1, :, :length], m)[0])
        out = torch.cat(parts)[None]
    return out, None


def _register_ragged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if RAGGED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(RAGGED_ATTENTION, _ragged_sdpa)
        AttentionMaskInterface.register(RAGGED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _read_lengths(span: int, rows: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Columns each of rows ``0..span-1`` reads in a decode pass: ``rows`` up to their
    ``ends``, any other (padding) row column 0 only."""
    seen = [1] * span
    for i, end in zip(rows, ends, strict=True):
        seen[i] = end
    return seen


def _kernel_serves(model: PreTrainedModel, kv_dtype: torch.dtype) -> bool:
    """Whether an :class:`HFGenerator` of ``model`` reads a ``kv_dtype`` cache through the
    compiled decode kernel: an SDPA model on a CPU, with a head size and grouping it serves."""
    config = model.config
    param = next(model.parameters())
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // heads if heads else 0)
    return bool(getattr(config, "_attn_implementation", "eager") == "sdpa"
                and param.device.type == "cpu" and heads and heads % kv_heads == 0
                and supported(head_dim, heads // kv_heads, param.dtype, kv_dtype))


#: ``rollout.kv_dtype`` values and the cache dtype each names (None: the model's own).
KV_DTYPES: dict[str, torch.dtype | None] = {
    "bfloat16": torch.bfloat16, "float32": torch.float32, "model": None}


def resolve_kv_dtype(name: str, model: PreTrainedModel) -> torch.dtype | None:
    """``rollout.kv_dtype`` as :class:`HFGenerator` takes it for ``model`` (None: the model's
    dtype). The value alone decides, never the machine: a cache dtype other than the model's
    needs SDPA attention, and any other model is refused with the key to change."""
    if name not in KV_DTYPES:
        raise ValueError(f"unknown rollout.kv_dtype {name!r}; expected one of "
                         f"{', '.join(KV_DTYPES)}")
    dtype = KV_DTYPES[name]
    attention = getattr(model.config, "_attn_implementation", "eager")
    if dtype not in (None, next(model.parameters()).dtype) and attention != "sdpa":
        raise ValueError(f"rollout.kv_dtype {name!r} differs from the model's dtype and needs "
                         f"SDPA attention; this model uses {attention!r}: set rollout.kv_dtype "
                         f"to 'model'")
    return dtype


class _RaggedCache(Cache):
    """KV cache of ``rows`` sequences of independent lengths, written in place.

    Per layer, keys and values live in preallocated ``[rows, H_kv, capacity + 1, D]`` tensors;
    a row's token at position p sits in column p, and column ``capacity`` is scratch where
    padding tokens write. Before each forward :meth:`plan` says which rows the batch holds
    (``None``: rows ``0..b-1``, read without copying), the column each input token writes, and
    how many columns attention reads. The caller builds the matching 4-D mask.

    ``dtype``: what keys and values are stored (and attention reads) in; None: as they come.
    """

    def __init__(self, rows: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[])
        self.n_rows = rows
        self.dtype = dtype
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows: torch.Tensor | None = None
        self._write = torch.zeros((0, 0), dtype=torch.long)
        self._width = 0
        self._packed = False

    def reserve(self, columns: int) -> None:
        """Room for positions ``0..columns-1`` in every row (grows by doubling, keeping data)."""
        if columns <= self.capacity:
            return
        new = max(columns, 2 * self.capacity, 256)
        new = -(-new // 64) * 64
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_zeros((*old.shape[:2], new + 1, old.shape[3]))
                grown[:, :, :self.capacity] = old[:, :, :self.capacity]
                store[i] = grown
        self.capacity = new

    def move(self, src: int, dst: int, columns: int) -> None:
        """Copy row ``src``'s first ``columns`` positions into row ``dst`` (every layer)."""
        for store in (self.keys, self.values):
            for layer in store:
                layer[dst, :, :columns] = layer[src, :, :columns]

    @property
    def scratch(self) -> int:
        return self.capacity

    def plan(self, rows: torch.Tensor | None, write: torch.Tensor, width: int,
             packed: bool = False) -> None:
        """Shape: rows (b,) or None, write (b, T) column per input token; width: columns read.
        ``packed``: the batch is one sequence (b = 1) whose token j writes row ``rows[j]``;
        attention gets every row."""
        self._rows, self._write, self._width, self._packed = rows, write, width, packed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Shape: key/value states (b, H_kv, T, D) → keys, values (b, H_kv, width, D)."""
        if self.dtype is not None:
            key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        if layer_idx == len(self.keys):
            shape = (self.n_rows, key_states.shape[1], self.capacity + 1, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros((*shape[:3], value_states.shape[3])))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._packed:
            assert self._rows is not None
            keys[self._rows, :, self._write[0]] = key_states[0].transpose(0, 1)
            values[self._rows, :, self._write[0]] = value_states[0].transpose(0, 1)
            return keys[:, :, :self._width], values[:, :, :self._width]
        b = key_states.shape[0]
        rows = self._rows if self._rows is not None else torch.arange(b, device=keys.device)
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is (b, T, H, D).
        keys[rows[:, None], :, self._write] = key_states.transpose(1, 2)
        values[rows[:, None], :, self._write] = value_states.transpose(1, 2)
        if self._rows is None:
            return keys[:b, :, :self._width], values[:b, :, :self._width]
        return (keys[:, :, :self._width].index_select(0, rows),
                values[:, :, :self._width].index_select(0, rows))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclasses.dataclass
class _Row:
    """One row of the batch: the key it serves and the tokens whose KV it holds."""

    key: Hashable | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    #: The request in flight (None: idle, the cache kept for the key's next request).
    sampling: Sampling | None = None
    todo: list[int] = dataclasses.field(default_factory=list)   # prompt tokens to compute
    out: list[int] = dataclasses.field(default_factory=list)    # response so far
    entropy: float = 0.0
    feed: int | None = None   # the last sampled token, to be fed next
    rng: torch.Generator | None = None
    used: int = 0             # when it last served a request (idle rows go LRU first)
    #: Commands the response's action must be one of (None: free), and, once the response
    #: has its ``Action:`` label, the token sequences of the responses still possible.
    choices: list[str] | None = None
    paths: list[list[int]] | None = None


class HFGenerator(Streaming):
    """In-process transformers generation with continuous batching.

    Up to ``max_rows`` requests run at once, each in its own row of a KV cache whose rows have
    independent lengths. Each :meth:`poll` advances every generating row by one token and
    computes the prompts of newly arrived requests (their first token), in one forward pass
    that packs the decode tokens and the prompts into one sequence (SDPA models, checked once
    against a plain forward pass; otherwise, or when no row is decoding yet, the prompts get a
    pass of their own, whose rows then decode in the same poll); a finished row returns its
    response at once and takes the next request, and rows held above the freed ones move down
    into them. SDPA models' decode tokens (and a packed pass's prompt tokens) attend through
    the compiled kernel of :mod:`hisr_core.rollout.cpu.decode_attention` (each row read only to
    its own length) where it serves the model, else through SDPA over the rows in use, read to
    the longest. A key's cache stays in its row between requests, so the next prompt of an episode is computed only from where it
    stops sharing a prefix with what the row holds: a turn costs its new observation.

    Models the ragged cache cannot serve (checked once against a plain forward pass, e.g.
    sliding-window attention) are run without a cache: each step recomputes the sequences.

    A request may name ``choices``: once its response has written its ``Action:`` label, each
    next token is chosen only among those that continue one of the responses ending in a
    listed command (the response tokenized whole, as training sees it), then a stop token.
    The policy's own next-token distribution picks the command, token by token, at no extra
    forward pass; a response whose tokens cannot continue any of them stays free.

    Args:
        model: a causal LM (eval mode is set here).
        tokenizer: its tokenizer (decodes responses).
        stop_ids: token ids that end a response (the prompt builder's ``stop_ids``).
        seed: seed of sampling (each key draws from its own generator, so a response does not
            depend on which other requests shared its batch).
        max_rows: most requests generating at once.
        kv_dtype: what the KV cache is stored in (None: the model's dtype); attention computes
            in the model's dtype. Decoding many rows on a CPU is bound by reading the cache,
            so bfloat16 under a float32 model halves what each step reads (needs SDPA).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 stop_ids: Sequence[int], seed: int = 0, max_rows: int = 32,
                 kv_dtype: torch.dtype | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        attention = getattr(model.config, "_attn_implementation", "eager")
        dtype = next(model.parameters()).dtype
        if kv_dtype is not None and kv_dtype != dtype and attention != "sdpa":
            raise ValueError(f"a {kv_dtype} KV cache under a {dtype} model needs SDPA "
                             f"attention; this model uses {attention!r}")
        self._own_attention = attention == "sdpa"
        if self._own_attention:
            _register_ragged_attention()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stop = set(stop_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.device = next(model.parameters()).device
        self.seed = seed
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept either.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._bool_mask = attention != "eager"
        self._rows = [_Row() for _ in range(max_rows)]
        self._where: dict[Hashable, int] = {}
        self._waiting: list[tuple[Hashable, list[int], Sampling, list[str] | None]] = []
        self._clock = 0
        self._cache = _RaggedCache(max_rows, kv_dtype)
        # Decode tokens read the cache through the compiled kernel where it serves the model.
        self._kernel = _kernel_serves(model, kv_dtype or dtype)
        self._ragged = self._matches_plain(packed=False)
        self._packed = self._ragged and self._own_attention and self._matches_plain(packed=True)
        #: Prompt tokens computed, and taken from a key's cache, so far.
        self.stats = {"prompt_tokens_computed": 0, "prompt_tokens_reused": 0}

    # -- requests ---------------------------------------------------------------------------

    #: ``submit`` takes ``choices`` (the engine's ``action_choice: constrained``).
    constrains_actions = True

    def submit(self, key: Hashable, prompt: Sequence[int], sampling: Sampling,
               choices: Sequence[str] | None = None) -> None:
        """``choices``: the commands the response's action is decoded among (see the class)."""
        if not prompt:
            raise ValueError(f"empty prompt for {key!r}")
        if key in self._where and self._rows[self._where[key]].sampling is not None or \
                any(k == key for k, _, _, _ in self._waiting):
            raise ValueError(f"{key!r} already has a request in flight")
        if choices is not None and not choices:
            raise ValueError(f"empty choices for {key!r}")
        self._waiting.append((key, list(prompt), sampling,
                              list(choices) if choices is not None else None))

    def release(self, key: Hashable) -> None:
        self._waiting = [w for w in self._waiting if w[0] != key]
        if key in self._where:
            self._rows[self._where.pop(key)] = _Row()

    def _admit(self) -> None:
        """Give waiting requests their key's row, else a free one, else the least recently
        used idle one (its cache is dropped)."""
        still = []
        for key, prompt, sampling, choices in self._waiting:
            i = self._where.get(key)
            if i is None:
                free = [j for j, r in enumerate(self._rows) if r.key is None]
                idle = sorted((r.used, j) for j, r in enumerate(self._rows)
                              if r.key is not None and r.sampling is None)
                if not free and not idle:
                    still.append((key, prompt, sampling, choices))
                    continue
                i = free[0] if free else idle[0][1]
                if self._rows[i].key is not None:
                    del self._where[self._rows[i].key]
                self._rows[i] = _Row(key=key)
                self._where[key] = i
            row = self._rows[i]
            # At least one prompt token is computed, for the next-token logits.
            keep = min(_common_prefix(row.ids, prompt), len(prompt) - 1) if self._ragged else 0
            self.stats["prompt_tokens_reused"] += keep
            self.stats["prompt_tokens_computed"] += len(prompt) - keep
            self._clock += 1
            if row.rng is None and sampling.temperature > 0:
                row.rng = torch.Generator().manual_seed(key_seed(self.seed, key))
            row.ids, row.todo, row.sampling, row.used = row.ids[:keep], prompt[keep:], sampling, \
                self._clock
            row.out, row.entropy, row.feed = [], 0.0, None
            row.choices, row.paths = choices, None
        self._waiting = still

    def _compact(self) -> None:
        """Move the rows held above the first ``len(held)`` into the freed rows below them.

        A decode pass spans rows ``0..max(rows)``: once freed rows are no longer taken (the
        end of a collection, of each PPO iteration), scattered rows would have every pass
        compute the empty rows between them. Waiting requests take the freed rows first
        (:meth:`_admit` runs before this), so each held row moves at most once.
        """
        if not self._ragged:
            return
        held = [i for i, r in enumerate(self._rows) if r.key is not None]
        free = [i for i in range(len(held)) if self._rows[i].key is None]
        for src, dst in zip(reversed(held[len(held) - len(free):]), free, strict=True):
            row = self._rows[src]
            self._cache.move(src, dst, len(row.ids))
            self._rows[dst], self._rows[src] = row, _Row()
            self._where[row.key] = dst

    @torch.inference_mode()
    def poll(self) -> list[tuple[Hashable, Generation]]:
        self._admit()
        self._compact()
        done: list[tuple[Hashable, Generation]] = []
        fill = [i for i, r in enumerate(self._rows) if r.sampling is not None and r.todo]
        step = [i for i, r in enumerate(self._rows) if r.feed is not None]
        if fill and step and self._packed:
            logits = self._forward_packed(step, fill)
            self._computed(step + fill)
            return self._pick(step + fill, logits)
        if fill:
            logits = self._forward(fill, [self._rows[i].todo for i in fill], dense=False)
            self._computed(fill)
            done += self._pick(fill, logits)
        step = [i for i, r in enumerate(self._rows) if r.feed is not None]
        if step:
            logits = self._forward(step, [[self._rows[i].feed] for i in step], dense=True)
            self._computed(step)
            done += self._pick(step, logits)
        return done

    def _computed(self, rows: list[int]) -> None:
        """The rows' prompt tokens or fed token are in the cache now: into ``ids``."""
        for i in rows:
            r = self._rows[i]
            r.ids += r.todo if r.todo else [r.feed]
            r.todo, r.feed = [], None

    # -- model ------------------------------------------------------------------------------

    def _forward(self, rows: list[int], feeds: list[list[int]], dense: bool) -> torch.Tensor:
        """Logits (len(rows), V) float32 after each row's ``feeds`` tokens, appended to what
        the row holds. ``dense``: the batch is rows ``0..max(rows)`` (others padding), so the
        cache is read in place; otherwise just ``rows``, gathered."""
        starts = [len(self._rows[i].ids) for i in rows]
        if not self._ragged:
            return self._plain([self._rows[i].ids + f for i, f in zip(rows, feeds, strict=True)])
        width = max(s + len(f) for s, f in zip(starts, feeds, strict=True))
        self._cache.reserve(width)
        b = max(rows) + 1 if dense else len(rows)
        t = max(len(f) for f in feeds)
        ids = torch.full((b, t), self.pad_id, dtype=torch.long)
        pos = torch.zeros((b, t), dtype=torch.long)
        write = torch.full((b, t), self._cache.scratch, dtype=torch.long)
        # Each row's tokens right-aligned, placed by one indexed write per tensor (not four
        # small tensor ops per row, which add up at B=32).
        at = (torch.tensor([i if dense else j
                            for j, (i, f) in enumerate(zip(rows, feeds, strict=True)) for _ in f]),
              torch.tensor([t - len(f) + k for f in feeds for k in range(len(f))]))
        ids[at] = torch.tensor([x for f in feeds for x in f], dtype=torch.long)
        pos[at] = write[at] = torch.tensor(
            [s + k for s, f in zip(starts, feeds, strict=True) for k in range(len(f))])
        # A real token sees its row up to itself; padding sees column 0 (never an empty row).
        mask = (torch.arange(width)[None, None, :] <= pos[:, :, None])[:, None]
        picked = torch.tensor(rows, dtype=torch.long, device=self.device)
        self._cache.plan(None if dense else picked, write.to(self.device), width)
        plan = None
        if dense and self._kernel:
            seen = _read_lengths(b, rows, [s + len(f) for s, f in zip(starts, feeds, strict=True)])
            plan = _Plan(span=b, lengths=torch.tensor(seen))
        logits = self._call(ids, pos, self._mask(mask), self._cache, plan)
        return logits.index_select(0, picked) if dense else logits

    def _forward_packed(self, step: list[int], fill: list[int]) -> torch.Tensor:
        """Logits (len(step) + len(fill), V) float32 of one pass over the ``step`` rows' fed
        tokens and the ``fill`` rows' prompt tokens, packed into one sequence: the prompts
        cost no pass of their own (their per-pass overhead is most of what they cost)."""
        rows = step + fill
        feeds = [[self._rows[i].feed] for i in step] + [self._rows[i].todo for i in fill]
        starts = [len(self._rows[i].ids) for i in rows]
        width = max(s + len(f) for s, f in zip(starts, feeds, strict=True))
        self._cache.reserve(width)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long)[None]
        pos = torch.tensor([s + k for s, f in zip(starts, feeds, strict=True)
                            for k in range(len(f))])[None]
        owner = torch.tensor([i for i, f in zip(rows, feeds, strict=True) for _ in f],
                             device=self.device)
        last = list(range(len(step)))   # where each row's logits are: its last token
        for f in feeds[len(step):]:
            last.append(last[-1] + len(f))
        span, decode = max(step) + 1, torch.tensor(step, device=self.device)
        if self._kernel:
            # Each token, decode or prompt, reads its own row up to itself (column ``pos``),
            # all in one kernel call: a prompt's tokens re-read its row from the CPU's caches.
            plan = _Plan(span=span, decode=decode, rows=owner, lengths=pos[0] + 1)
        else:
            prompts = []
            for i, s, f, stop in zip(fill, starts[len(step):], feeds[len(step):],
                                     last[len(step):], strict=True):
                mask = torch.arange(s + len(f))[None, :] <= torch.arange(s, s + len(f))[:, None]
                prompts.append((i, stop + 1 - len(f), stop + 1, mask[None, None].to(self.device)))
            seen = _read_lengths(span, step, [s + 1 for s in starts[:len(step)]])
            decode_mask = torch.arange(max(seen))[None, :] < torch.tensor(seen)[:, None]
            plan = _Plan(span, decode, decode_mask[:, None, None].to(self.device), prompts)
        self._cache.plan(owner, pos.to(self.device), width, packed=True)
        keep = torch.tensor(last)
        # The model's own mask handling takes a 4-D mask as given; attention reads the plan.
        mask = torch.ones((1, 1, ids.shape[1], width), dtype=torch.bool, device=self.device)
        return self._call(ids, pos, mask, self._cache, plan, keep)

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean 4-D mask as the model's attention takes it (eager: additive floats)."""
        allowed = allowed.to(self.device)
        if self._bool_mask:
            return allowed
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
              cache: Cache | None, plan: _Plan | None = None, keep: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Logits (B, V) float32 at each row's last position; ``keep``: at those positions of
        a one-sequence batch instead, (len(keep), V)."""
        keep_arg = self._keep_arg
        if keep is not None and keep_arg:
            keep_arg = {"logits_to_keep": keep.to(self.device)}
        with self._attention(plan):
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask,
                             position_ids=pos.to(self.device), use_cache=cache is not None,
                             **({self._cache_arg: cache} if cache is not None else {}),
                             **keep_arg)
        if keep is None:
            return out.logits[:, -1].float()
        return (out.logits[0] if keep_arg else out.logits[0, keep.to(self.device)]).float()

    @contextlib.contextmanager
    def _attention(self, plan: _Plan | None) -> Iterator[None]:
        """An SDPA model under :data:`RAGGED_ATTENTION` reading ``plan``, for one forward pass
        only (the model is shared, e.g. PPO trains it between rollouts)."""
        if not self._own_attention:
            yield
            return
        config = self.model.config
        saved = config._attn_implementation
        config._attn_implementation = RAGGED_ATTENTION
        token = _PLAN.set(plan)
        try:
            yield
        finally:
            _PLAN.reset(token)
            config._attn_implementation = saved

    def _plain(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits (len(seqs), V) after each whole sequence, without a cache (left padding)."""
        t = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), t), self.pad_id, dtype=torch.long)
        keep = torch.zeros((len(seqs), t), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, t - len(s):] = torch.tensor(list(s), dtype=torch.long)
            keep[j, t - len(s):] = 1
        pos = (keep.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(self.device), attention_mask=keep.to(self.device),
                         position_ids=pos.to(self.device), use_cache=False, **self._keep_arg)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def _matches_plain(self, packed: bool) -> bool:
        """Whether the ragged cache gives this model's plain logits: two rows of different
        lengths, a prompt pass, then one token each (``packed``: one row's token while the
        other computes the rest of its prompt, in a packed pass), against whole-sequence
        passes (the cache in the model's dtype: this checks the layout, not a ``kv_dtype``'s
        rounding). Any failure means no: the model runs without a cache (without packing)."""
        vocab = min(int(getattr(self.model.config, "vocab_size", 64) or 64), 64)
        seqs = [[(7 * k + 3) % vocab for k in range(6)], [(5 * k + 1) % vocab for k in range(9)]]
        cut = [5, 6] if packed else [5, 8]
        saved = self._rows, self._cache
        self._rows, self._cache, self._ragged = [_Row(), _Row()], _RaggedCache(2), True
        try:
            self._forward([0, 1], [s[:n] for s, n in zip(seqs, cut, strict=True)], dense=False)
            for r, s, n in zip(self._rows, seqs, cut, strict=True):
                r.ids = s[:n]
            if packed:
                self._rows[0].feed, self._rows[1].todo = seqs[0][5], seqs[1][6:]
                got = self._forward_packed([0], [1])
            else:
                got = self._forward([0, 1], [[seqs[0][-1]], [seqs[1][-1]]], dense=True)
            want = self._plain(seqs)
            return bool(torch.allclose(got, want, atol=1e-3 * float(want.abs().max()) + 1e-4))
        except Exception:  # noqa: BLE001 - any failure means: not this way for this model
            return False
        finally:
            self._rows, self._cache = saved

    # -- sampling ---------------------------------------------------------------------------

    def _allowed(self, row: _Row) -> list[int] | None:
        """The tokens a row decoding among ``choices`` may take next (None: any)."""
        if row.choices is None:
            return None
        n = len(row.out)
        if row.paths is None:
            text = self.tokenizer.decode(row.out, skip_special_tokens=True)
            end = action_label_end(text)
            if end is None:
                return None
            head = text[:end]
            seqs = self.tokenizer([f"{head} {c}" for c in row.choices],
                                  add_special_tokens=False)["input_ids"]
            # Only responses the tokens so far already spell (token boundaries included).
            row.paths = [list(s) for s in seqs if len(s) >= n and s[:n] == row.out]
        if not row.paths:
            return None
        allowed = {p[n] for p in row.paths if len(p) > n}
        if any(len(p) == n for p in row.paths):
            allowed |= self.stop
        return sorted(allowed)

    def _pick(self, rows: list[int], logits: torch.Tensor) -> list[tuple[Hashable, Generation]]:
        """Choose each row's next token from its logits (n, V); the responses that ended."""
        logp = torch.log_softmax(logits, dim=-1)
        entropy = (-(logp.exp() * logp).sum(-1)).tolist()
        # Entropy is the policy's; the choice is among the tokens a constrained row allows.
        for j, i in enumerate(rows):
            allowed = self._allowed(self._rows[i])
            if allowed is not None:
                keep = torch.full_like(logits[j], float("-inf"))
                index = torch.tensor(allowed, device=logits.device)
                logits[j] = keep.index_copy(0, index, logits[j, index])
        choice = logits.argmax(-1).cpu()
        sampled = [j for j, i in enumerate(rows) if self._rows[i].sampling.temperature > 0]
        if sampled:
            settings = [self._rows[rows[j]].sampling for j in sampled]
            rngs = [self._rows[rows[j]].rng for j in sampled]
            choice[sampled] = _sample(logits[sampled].cpu(), settings, rngs)
        done = []
        for j, token in enumerate(choice.tolist()):
            row = self._rows[rows[j]]
            assert row.sampling is not None
            if token not in self.stop:
                if row.paths:
                    n = len(row.out)
                    row.paths = [p for p in row.paths if len(p) > n and p[n] == token]
                row.out.append(token)
                row.entropy += entropy[j]
                row.feed = token
            if token in self.stop or len(row.out) >= row.sampling.max_new_tokens:
                # A response cut at max_new_tokens leaves its last token unfed: the row holds
                # exactly the tokens in ``ids``.
                row.feed = None
                row.sampling = None
                text = self.tokenizer.decode(row.out, skip_special_tokens=True)
                done.append((row.key, Generation(
                    row.out, text, row.entropy / len(row.out) if row.out else 0.0)))
        return done


def _sample(logits: torch.Tensor, settings: Sequence[Sampling],
            rngs: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Shape: logits (n, V) → (n,) tokens, row j drawn at ``settings[j].temperature`` from the
    smallest set of tokens whose probability reaches ``settings[j].top_p``, with one uniform
    number from its own generator ``rngs[j]`` (so a draw does not depend on the other rows)."""
    temperature = torch.tensor([s.temperature for s in settings])[:, None]
    top_p = torch.tensor([s.top_p for s in settings])[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g) for g in rngs]) * cdf[:, -1]
    # Inverse CDF: the first token whose cumulative mass exceeds u (never a zero-mass one).
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp(max=cdf.shape[1] - 1)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

