"""Turns a public GenerateRequest into a validated job: model, prompt ids, sampling, stopping.

Every rejection is a RouterError carrying the gRPC status code and a message that names the
offending field and value; nothing here touches a worker.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, replace

import grpc
import jinja2

from megaserve.checkpoint import TokenizerInfo
from megaserve.errors import RequestError
from megaserve.rpc import decode_pb2
from megaserve.sampling_params import MAX_LOGPROBS, SamplingParams
from megaserve.v1 import generation_pb2 as pb
from router.stop_strings import StopStringMatcher

ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID = 256
MAX_SESSION_ID = 256
# Output tokens of a request that left max_tokens at 0 on a worker that publishes no context.
DEFAULT_MAX_TOKENS = 256
# A chat message's characters for its size check: its content and role, plus what the
# template adds around it (ChatML: "<|im_start|>" role "\n" ... "<|im_end|>\n", 24), so a
# chat of many empty messages is refused before its template is rendered.
CHAT_MESSAGE_CHARS = 16
MAX_STOP_TOKEN_IDS = 64
# Text beyond this is refused before tokenizing (no context is this long; caps the work):
# CHARS_PER_TOKEN_MAX characters per context token, or MAX_PROMPT_CHARS if no context is known.
MAX_PROMPT_CHARS = 4_000_000
CHARS_PER_TOKEN_MAX = 32
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


class RouterError(Exception):
    """A request the router refuses: gRPC code + message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message)


def shown(value: str, limit: int = 64) -> str:
    """A client's string for an error message: repr, cut at `limit` characters with its
    length (a status message travels in a header: 16 KiB at most, or the call fails)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def input_chars(req) -> int:
    """The size a prompt or chat is checked against (characters; a chat counts each
    message's template framing too)."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        return len(req.prompt)
    if kind == "chat":
        ms = req.chat.messages
        return sum(len(m.content) + len(m.role) for m in ms) + CHAT_MESSAGE_CHARS * len(ms)
    return 0


def check_input_size(req, max_context: int | None) -> None:
    """Refuses text too long for any context before it is tokenized (caps the work):
    CHARS_PER_TOKEN_MAX characters a context token, MAX_PROMPT_CHARS if no context is known."""
    limit = CHARS_PER_TOKEN_MAX * max_context if max_context else MAX_PROMPT_CHARS
    n = input_chars(req)
    if n > limit:
        kind = req.WhichOneof("input")
        framing = " (with its messages' template framing)" if kind == "chat" else ""
        raise invalid(f"{kind} is {n} characters{framing}; at most {limit} here")


@dataclass(frozen=True)
class Job:
    """One validated public request, ready to place."""

    request_id: str
    model: TokenizerInfo
    prompt: list[int]
    sampling: decode_pb2.SamplingParams  # what every worker attempt is given
    max_tokens: int  # 0 while no worker had told its context: resolved at placement (with_budget)
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    session_id: str
    logprobs: int | None = None  # None: not asked; else alternatives per token (0: none)
    prompt_logprobs: int | None = None  # the same for prompt tokens (LogprobsParams.prompt)


def with_budget(job: Job, contexts: list[int]) -> Job:
    """job with max_tokens resolved: left at 0 while no worker had told the router its
    context (a router just started), it is made "up to the smallest context of the workers
    it may run on" now (a fixed default would be refused by the worker for a long prompt,
    citing a max_tokens the client never set). Once, so a migration keeps it."""
    if job.max_tokens:
        return job
    known = [c for c in contexts if c]
    if not known:  # workers that publish no context
        return replace(job, max_tokens=DEFAULT_MAX_TOKENS)
    if len(job.prompt) >= min(known):
        raise invalid(
            f"prompt is {len(job.prompt)} tokens; the context limit of {job.model.name!r} is "
            f"{min(known)}"
        )
    return replace(job, max_tokens=min(known) - len(job.prompt))


def resolve_model(name: str, models: dict[str, TokenizerInfo]) -> TokenizerInfo:
    if not name:
        if len(models) == 1:
            return next(iter(models.values()))
        raise invalid(f"model is empty and this router serves {sorted(models)}: name one")
    if name not in models:
        raise RouterError(
            grpc.StatusCode.NOT_FOUND, f"model {shown(name)} is not served; known: {sorted(models)}"
        )
    return models[name]


def chat_messages(chat: pb.Chat) -> list[dict]:
    if not chat.messages:
        raise invalid("chat.messages is empty")
    out = []
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise invalid(f"chat.messages[{i}].role={shown(m.role)}: must be one of {ROLES}")
        out.append({"role": m.role, "content": m.content})
    return out


def prompt_ids(req, model: TokenizerInfo, max_context: int | None = None) -> list[int]:
    """Token ids of the request's input (text, chat or ids)."""
    kind = req.WhichOneof("input")
    tok = model.tokenizer
    if kind is None:
        raise invalid("no input: set one of prompt, prompt_token_ids, chat")
    check_input_size(req, max_context)
    if kind == "prompt":
        if not req.prompt:
            raise invalid("prompt is empty")
        ids = tok.encode(req.prompt)
    elif kind == "chat":
        try:
            ids = tok.encode_chat(chat_messages(req.chat))
        except (ValueError, jinja2.TemplateError) as e:  # e.g. roles out of order, no template
            raise invalid(f"chat template refused the messages: {e}") from e
    else:
        ids = list(req.prompt_token_ids.ids)
        bad = None
        if ids and (min(ids) < 0 or max(ids) >= model.vocab_size):  # (C speed: the usual case)
            bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < model.vocab_size]
        if bad:
            i, t = bad[0]
            raise invalid(
                f"prompt_token_ids[{i}]={t} outside the vocabulary [0, {model.vocab_size})"
                + (f" ({len(bad)} ids in all)" if len(bad) > 1 else "")
            )
    if not ids:
        raise invalid(f"{kind} gives no tokens")
    return ids


def sampling(p: pb.SamplingParams) -> decode_pb2.SamplingParams:
    """The public sampling fields validated (errors name `sampling.<field>`), as every worker
    attempt receives them."""
    # A fixed seed per request keeps a migrated request's samples equal to an uninterrupted run.
    seed = p.seed if p.HasField("seed") else random.getrandbits(32)
    try:
        params = SamplingParams.from_proto(p, seed=seed, prefix="sampling.")
    except RequestError as e:
        raise invalid(str(e)) from None
    # As params.to_proto, without dataclasses.asdict's deep copy (on every request).
    return decode_pb2.SamplingParams(**{f: getattr(params, f) for f in _SAMPLING_FIELDS})


def parse_generate(
    req: pb.GenerateRequest, models: dict[str, TokenizerInfo], max_context: int | None, new_id
) -> Job:
    """Validates req; max_context is the smallest context of the model's decode workers."""
    if len(req.request_id) > MAX_REQUEST_ID:
        raise invalid(f"request_id is {len(req.request_id)} chars; at most {MAX_REQUEST_ID}")
    if len(req.session_id) > MAX_SESSION_ID:
        raise invalid(f"session_id is {len(req.session_id)} chars; at most {MAX_SESSION_ID}")
    model = resolve_model(req.model, models)
    ids = prompt_ids(req, model, max_context)
    s = sampling(req.sampling)
    st = req.stopping
    if st.max_tokens < 0:
        raise invalid(f"stopping.max_tokens={st.max_tokens} must be >= 0 (0 = up to the context)")
    max_tokens = st.max_tokens
    if max_context:
        if len(ids) >= max_context:
            raise invalid(
                f"prompt is {len(ids)} tokens; the context limit of {model.name!r} is {max_context}"
            )
        if max_tokens == 0:
            max_tokens = max_context - len(ids)
        elif len(ids) + max_tokens > max_context:
            raise invalid(
                f"prompt ({len(ids)} tokens) + stopping.max_tokens ({max_tokens}) exceeds the "
                f"context limit {max_context} of {model.name!r}"
            )
    try:
        StopStringMatcher(list(st.stop))
    except ValueError as e:
        raise invalid(f"stopping.stop: {e}") from e
    if len(st.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"stopping.stop_token_ids has {len(st.stop_token_ids)} ids; at most 64")
    for i, t in enumerate(st.stop_token_ids):
        if not 0 <= t < model.vocab_size:
            raise invalid(f"stopping.stop_token_ids[{i}]={t} outside [0, {model.vocab_size})")
    return Job(
        req.request_id or new_id(),
        model,
        ids,
        s,
        max_tokens,
        tuple(st.stop),
        tuple(st.stop_token_ids),
        st.ignore_eos,
        req.session_id,
        logprobs_asked(req.logprobs),
        prompt_logprobs_asked(req.logprobs, len(ids)),
    )


def logprobs_asked(lp: pb.LogprobsParams) -> int | None:
    """None when the request wants no log-probabilities, else its top_n."""
    if not 0 <= lp.top_n <= MAX_LOGPROBS:
        raise invalid(f"logprobs.top_n={lp.top_n} must be in [0, {MAX_LOGPROBS}]")
    return lp.top_n if lp.enabled or lp.top_n else None


def prompt_logprobs_asked(lp: pb.LogprobsParams, prompt_tokens: int) -> int | None:
    """None when the request wants no prompt log-probabilities, else its prompt_top_n."""
    if not 0 <= lp.prompt_top_n <= MAX_LOGPROBS:
        raise invalid(f"logprobs.prompt_top_n={lp.prompt_top_n} must be in [0, {MAX_LOGPROBS}]")
    if not (lp.prompt or lp.prompt_top_n):
        return None
    if prompt_tokens < 2:  # the first token has no context: nothing would be scored
        raise invalid(
            f"logprobs.prompt scores the prompt tokens after the first; the prompt has "
            f"{prompt_tokens} token"
        )
    return lp.prompt_top_n
