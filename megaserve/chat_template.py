"""Chat templates: Jinja rendering with the environment transformers gives Hub templates."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megaserve.errors import RequestError

ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (as transformers does).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
) -> str:
    """Renders messages ([{role, content}]) to the prompt text the model was trained on."""
    if not messages:
        raise RequestError("chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"message {i} has role {m.get('role')!r}; expected one of {ROLES}")
        if not isinstance(m.get("content"), str):
            raise RequestError(f"message {i} content must be a string")
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
        )
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"chat template rejected the messages: {e}") from e
