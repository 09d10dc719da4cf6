"""Prompt building: episodes as chat token ids, with a mask marking response tokens.

One module serves SFT, rollouts, the reward models and PPO. An episode is a chat: a system
message (what the agent is, the command grammar unless ``grammar=False``, the task), then for
every turn k the observation ``o_k`` as a user message and the response ``a_k`` as an
assistant message.

Token ids are built piece by piece: every wrapper string of the template (role headers, end
markers) and every message text is tokenized on its own and appended, and the response mask is
set for exactly the response pieces as they are appended (plus the end-of-turn token that closes
them, so the model learns to stop; it is a special token, dropped when decoding). Nothing is ever
found by searching decoded text. Models with a chat template use it: its wrapper strings are
read off once by rendering a conversation of sentinel strings, and the decomposition is checked
against the template's own rendering. Models without one use the plain template of
:mod:`hisr_core.agent.models`.

Context window: the system message plus the most recent ``history`` turns; older turns are
dropped whole (a response is never cut), and more whole turns are dropped while the prompt is
longer than ``max_tokens``. With ``past_admissible=False`` only the newest observation of a
sequence keeps the admissible list an environment appends (:data:`ADMISSIBLE_MARKER` on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from hisr_core.agent.models import ASSISTANT, END, SYSTEM, USER
from hisr_core.config import ModelParams
from hisr_core.envs.base import ADMISSIBLE_MARKER

SYSTEM_PREAMBLE = (
    "You are an agent in a text environment. Each turn you see an observation and answer with "
    "one line of reasoning and one command, exactly as:\nThought: <your reasoning>\n"
    "Action: <command>\n"
)


def system_text(instruction: str, grammar: Sequence[str]) -> str:
    """The system message of an episode (``grammar``: the environment's command templates;
    empty: no ``Commands:`` line)."""
    commands = f"Commands: {'; '.join(grammar)}.\n" if grammar else ""
    return f"{SYSTEM_PREAMBLE}{commands}Your task is to: {instruction}"


@dataclasses.dataclass(frozen=True)
class TemplateParts:
    """The wrapper strings of a chat format: ``sys_pre S sys_suf (user_pre U user_suf
    asst_pre A asst_suf)*``. ``asst_suf`` starts with the end-of-turn marker."""

    sys_pre: str
    sys_suf: str
    user_pre: str
    user_suf: str
    asst_pre: str
    asst_suf: str


def plain_parts(tokenizer: PreTrainedTokenizerBase) -> TemplateParts:
    """The plain template: builtin role markers; the end marker is ``<|end|>`` when the
    tokenizer has it (builtin models), the tokenizer's EOS text otherwise."""
    end = END if END in tokenizer.get_vocab() else tokenizer.eos_token
    if end is None:
        raise ValueError("tokenizer has neither a chat template nor an EOS token")
    return TemplateParts(SYSTEM, end, USER, end, ASSISTANT, end)


_S, _U0, _A0, _U1, _A1 = "SENTINELSYS", "SENTINELUSR0", "SENTINELAST0", "SENTINELUSR1", "SENTINELAST1"


def _cut(text: str, start: str, end: str) -> str:
    i = text.index(start) + len(start)
    return text[i:text.index(end, i)]


def chat_template_parts(tokenizer: PreTrainedTokenizerBase) -> TemplateParts:
    """Read the wrapper strings of ``tokenizer``'s chat template off sentinel renderings."""

    def render(msgs: list[tuple[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in msgs], tokenize=False,
            add_generation_prompt=gen)

    convo = [("system", _S), ("user", _U0), ("assistant", _A0), ("user", _U1), ("assistant", _A1)]
    full = render(convo, False)
    with_gen = render(convo[:2], True)
    without_gen = render(convo[:2], False)
    if not with_gen.startswith(without_gen):
        raise ValueError("chat template: the generation prompt does not extend the conversation")
    asst_pre = with_gen[len(without_gen):]
    user_suf_asst_pre = _cut(full, _U1, _A1)
    if not user_suf_asst_pre.endswith(asst_pre):
        raise ValueError("chat template renders assistant headers inconsistently")
    user_suf = user_suf_asst_pre[: len(user_suf_asst_pre) - len(asst_pre)]
    asst_suf = full[full.index(_A1) + len(_A1):]
    between = _cut(full, _A0, _U1)
    if not between.startswith(asst_suf):
        raise ValueError("chat template closes assistant turns inconsistently")
    user_pre = between[len(asst_suf):]
    sys_between = _cut(full, _S, _U0)
    if not sys_between.endswith(user_pre):
        raise ValueError("chat template renders user headers inconsistently")
    parts = TemplateParts(
        sys_pre=full[: full.index(_S)],
        sys_suf=sys_between[: len(sys_between) - len(user_pre)],
        user_pre=user_pre, user_suf=user_suf, asst_pre=asst_pre, asst_suf=asst_suf)
    rebuilt = (parts.sys_pre + _S + parts.sys_suf
               + "".join(parts.user_pre + u + parts.user_suf + parts.asst_pre + a + parts.asst_suf
                         for u, a in [(_U0, _A0), (_U1, _A1)]))
    if rebuilt != full:
        raise ValueError("chat template is not a plain concatenation of role pieces; "
                         "use a model without a chat template or the builtin model")
    return parts


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Token ids of a (partial) episode.

    Shape: all lists have length T (tokens).
        input_ids: token ids.
        response_mask: 1 on tokens of responses (and their end-of-turn token), else 0.
        turn_ids: the 0-based turn each token belongs to (-1 for the system message).
    ``turns`` lists the turns included, in order (oldest dropped first when truncated).
    ``block``: ``(start, end, at)`` of an inserted block the model reads through gated attention
    (:mod:`hisr_core.rewards.gated_attention`; a hindsight example's later turns and outcome), if any:
    tokens ``start..end-1``, placed at positions from ``at``.
    """

    input_ids: list[int]
    response_mask: list[int]
    turn_ids: list[int]
    turns: tuple[int, ...]
    block: tuple[int, int, int] | None = None


#: Pieces remembered by a :class:`PromptBuilder` before its memo starts again.
_MEMO_PIECES = 1 << 16


class PromptBuilder:
    """Encodes episodes for one tokenizer; wrapper pieces are tokenized once and cached.

    Args:
        tokenizer: any Hugging Face tokenizer (with or without a chat template).
        history: the most recent turns kept in context (``None``: all).
        max_tokens: the longest prompt or training sequence, in tokens.
        past_admissible: False drops the admissible list from every observation but the
            newest of a sequence.
        grammar: False leaves the environment's command templates out of the system message
            (:meth:`system`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, history: int | None = None,
                 max_tokens: int = 4096, past_admissible: bool = True,
                 grammar: bool = True) -> None:
        if history is not None and history < 0:
            raise ValueError(f"history must be >= 0 or None, got {history}")
        self.tokenizer = tokenizer
        self.history = history
        self.max_tokens = max_tokens
        self.past_admissible = past_admissible
        self.grammar = grammar
        # Every turn's prompt re-encodes the episode so far: its pieces are tokenized once.
        self._memo: dict[str, list[int]] = {}
        self.parts = (chat_template_parts(tokenizer) if getattr(tokenizer, "chat_template", None)
                      else plain_parts(tokenizer))
        p = self.parts
        self._sys_pre, self._sys_suf = self._ids(p.sys_pre), self._ids(p.sys_suf)
        self._user_pre, self._user_suf = self._ids(p.user_pre), self._ids(p.user_suf)
        self.assistant_prefix = self._ids(p.asst_pre)
        suf = self._ids(p.asst_suf)
        special = set(tokenizer.all_special_ids)
        # The end-of-turn marker is learned (masked in); template whitespace after it is not.
        n_end = next((i + 1 for i, t in enumerate(suf) if t in special), len(suf))
        self._asst_end, self._asst_tail = suf[:n_end], suf[n_end:]
        self.stop_ids = sorted({t for t in self._asst_end if t in special}
                               | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                  else set()))

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, model: ModelParams) -> PromptBuilder:
        """The builder ``params.model`` describes (history, max_tokens, past_admissible,
        grammar)."""
        return cls(tokenizer, model.history, model.max_tokens, model.past_admissible,
                   model.grammar)

    def system(self, instruction: str, grammar: Sequence[str]) -> str:
        """The system message of an episode: :func:`system_text`, with ``grammar`` (the
        environment's command templates) only when this builder shows it."""
        return system_text(instruction, grammar if self.grammar else ())

    def _ids(self, text: str) -> list[int]:
        """Token ids of one piece (shared with the memo: callers concatenate, never mutate)."""
        if not text:
            return []
        ids = self._memo.get(text)
        if ids is None:
            if len(self._memo) >= _MEMO_PIECES:
                self._memo.clear()
            ids = self._memo[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    # -- pieces ---------------------------------------------------------------------------
    def _system(self, system: str) -> list[int]:
        return self._sys_pre + self._ids(system) + self._sys_suf

    def _user(self, observation: str, newest: bool = True) -> list[int]:
        if not (newest or self.past_admissible):
            observation = observation.split(ADMISSIBLE_MARKER, 1)[0]
        return self._user_pre + self._ids(observation) + self._user_suf

    def _assistant(self, response: str) -> tuple[list[int], list[int], list[int]]:
        """(unmasked header, masked response + end marker, unmasked tail)."""
        return self.assistant_prefix, self._ids(response) + self._asst_end, self._asst_tail

    # -- windows --------------------------------------------------------------------------
    def window(self, k: int) -> range:
        """Turns in context when the agent answers turn ``k`` (0-based): the last ``history``."""
        start = 0 if self.history is None else max(0, k - self.history)
        return range(start, k)

    def encode(self, system: str, turns: Sequence[tuple[str, str]], first: int = 0,
               observation: str | None = None, train_from: int | None = None,
               learn: Sequence[bool] | None = None) -> Encoded:
        """Encode ``system`` + turns ``first..`` of ``turns`` (+ a pending ``observation``).

        ``turns`` are (observation, response) pairs. Responses of turns ``>= train_from``
        (default: all encoded turns) are masked in, except turns whose ``learn`` flag is False
        (they stay in context only). With ``observation`` the sequence ends with that user
        message and the assistant header: a generation prompt.
        """
        train_from = first if train_from is None else train_from
        ids, mask, owner = list(self._system(system)), [], []
        mask = [0] * len(ids)
        owner = [-1] * len(ids)
        for k in range(first, len(turns)):
            obs, resp = turns[k]
            user = self._user(obs, newest=observation is None and k == len(turns) - 1)
            head, body, tail = self._assistant(resp)
            on = int(k >= train_from and (learn is None or learn[k]))
            ids += user + head + body + tail
            mask += [0] * (len(user) + len(head)) + [on] * len(body) + [0] * len(tail)
            owner += [k] * (len(user) + len(head) + len(body) + len(tail))
        if observation is not None:
            user = self._user(observation) + self.assistant_prefix
            ids += user
            mask += [0] * len(user)
            owner += [len(turns)] * len(user)
        included = tuple(range(first, len(turns) + (observation is not None)))
        return Encoded(ids, mask, owner, included)

    def prompt(self, system: str, turns: Sequence[tuple[str, str]], observation: str) -> Encoded:
        """The generation prompt for the next turn: system, the window of past turns, the
        observation, and the assistant header; whole old turns dropped to fit ``max_tokens``."""
        first = self.window(len(turns)).start
        while True:
            enc = self.encode(system, turns, first, observation, train_from=len(turns))
            if len(enc.input_ids) <= self.max_tokens or first >= len(turns):
                break
            first += 1
        if len(enc.input_ids) > self.max_tokens:
            raise ValueError(f"prompt of {len(enc.input_ids)} tokens exceeds max_tokens="
                             f"{self.max_tokens} even without history")
        return enc

    def training_sequences(self, system: str, turns: Sequence[tuple[str, str]],
                           learn: Sequence[bool] | None = None) -> list[Encoded]:
        """Training sequences covering every response once, each response seen with exactly
        the context it gets at inference (the window of ``history`` turns, whole turns).

        The first sequence holds turns ``0..history`` and trains all of them (not without
        ``past_admissible``: there every turn gets its own); each later turn
        ``k`` gets its own sequence ``k-history..k`` training only response ``k``. If the first
        sequence is over ``max_tokens`` every turn gets its own; a sequence over ``max_tokens``
        drops its oldest context turns, as :meth:`prompt` does (never the trained response).
        Turns whose ``learn`` flag is False are context only (no sequence trains them).
        """
        m = len(turns)
        head_end = m if self.history is None else min(m, self.history + 1)
        # Without past lists a response is only seen as at inference while its turn is newest.
        head = self.encode(system, turns[:head_end], 0, learn=learn) if self.past_admissible \
            else None
        if head is not None and len(head.input_ids) <= self.max_tokens:
            out, rest = [head], range(head_end, m)
        else:
            out, rest = [], range(m)
        for k in rest:
            if learn is not None and not learn[k]:
                continue
            first = self.window(k).start
            while True:
                enc = self.encode(system, turns[:k + 1], first, train_from=k, learn=learn)
                if len(enc.input_ids) <= self.max_tokens:
                    break
                if first >= k:
                    raise ValueError(f"turn {k} alone needs {len(enc.input_ids)} tokens "
                                     f"> max_tokens={self.max_tokens}")
                first += 1
            out.append(enc)
        return out
