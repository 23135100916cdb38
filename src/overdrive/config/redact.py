"""Secrets masked at the output boundary: one place every printer and file writer goes through.

A value is a secret when its key's name says so (`hub_token`, `WANDB_API_KEY`: see
`env_report.is_secret_name`) or when its shape does, wherever it sits: a Hugging Face hub
token (`hf_...`), an API key (`sk-...`, `ghp_...`, `AKIA...`, `xoxb-...`), a bearer token,
or credentials inside a URL (`https://user:pass@host`). Text (messages, tables, command
lines echoed back) is scanned for the same shapes and for `name=value` / `name: value`
pairs whose name is a credential's.

    redact({"hub_token": "abc", "source": "https://u:p@host/x"})
    # {"hub_token": "***", "source": "https://***@host/x"}
"""

from __future__ import annotations

import re
from typing import Any

from overdrive.config.env_report import MASK, is_secret_name

_SHAPES = [
    # Lengths are the issuers' (a hub token is hf_ and 34 letters): a much shorter match is a name
    # (`hf_scripts`, `sk-learn`), and masking it would change a path or a value the run needs.
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),                         # Hugging Face hub tokens
    re.compile(r"\bapi_org_[A-Za-z0-9]{20,}\b"),                     # Hugging Face org API tokens
    re.compile(r"\bsk-(?:[A-Za-z]+-)?[A-Za-z0-9_-]{20,}"),           # OpenAI / Anthropic-style keys
    re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{16,}\b"),     # GitHub tokens
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{16,}"),
    re.compile(r"\bglpat-[A-Za-z0-9_-]{16,}"),                       # GitLab
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),                    # AWS access key ids
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{8,}"),                   # Slack
    re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"),                         # Google API keys
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),  # JWTs
]
_BEARER = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{8,}")
# user:password@ (or a lone token@) in a URL: the host is useful, the credentials are not.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]+@")
# ?token=... &api_key=... in a URL's query
_QUERY = re.compile(r"(?P<head>[?&;](?P<name>[A-Za-z0-9_.-]+)=)(?P<value>[^&;#\s'\"]+)")
# name=value and name: value pairs in text: `hub_token=abc`, `'api_key': 'abc'`, `HF_TOKEN: abc`
_PAIR = re.compile(
    r"(?P<q1>['\"])?(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?(q1)['\"])(?P<sep>\s*(?:=|:)\s*)"
    r"(?P<q2>['\"])?(?P<value>(?(q2)[^'\"\n]*|[^\s,;'\"}\])]+))"
)

# What precedes a key inside a YAML flow mapping: `{` or a comma (the text up to the pair's start).
_IN_MAPPING = re.compile(r"[{,]\s*\Z")


def redact_text(text: str) -> str:
    """`text` with every secret-shaped value and every credential-named pair masked."""
    if not isinstance(text, str) or not text:
        return text
    for shape in _SHAPES:
        text = shape.sub(MASK, text)
    text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    text = _URL_CREDENTIALS.sub(lambda m: m.group("scheme") + MASK + "@", text)
    text = _QUERY.sub(lambda m: m.group("head") + MASK if is_secret_name(m.group("name")) else m.group(0), text)

    def pair(match: re.Match) -> str:
        value, name = match.group("value"), match.group("name")
        # `name: value` is a pair when quoted (JSON, a dict), an environment variable (`HF_TOKEN: abc`)
        # or an entry of a YAML flow mapping (`{function: judge, api_key: abc}`, typed on a command line);
        # `hub_token: unknown key` in a message is a key and its problem.
        colon_pair = match.group("q1") or name.isupper() or _IN_MAPPING.search(match.string, 0, match.start())
        start, end = match.span("value")
        offset = match.start()
        if ":" in match.group("sep") and not colon_pair or not is_secret_name(name):
            # Not a secret itself, its value may hold one: `name: "judge_token=abc"`.
            inner = redact_text(value) if value and value != match.group(0) else value
            return match.group(0)[: start - offset] + inner + match.group(0)[end - offset:]
        if not value or value == MASK or value.lower() in ("none", "null"):
            return match.group(0)
        return match.group(0)[: start - offset] + MASK + match.group(0)[end - offset:]

    return _PAIR.sub(pair, text)


def is_secret_value(value: Any) -> bool:
    return isinstance(value, str) and redact_text(value) != value


def redact(node: Any, key: str = "") -> Any:
    """A copy of `node` (mappings, lists, strings) with secrets masked, by key name and by shape.

    `key` is the dotted name `node` sits under; a credential's name masks its whole value,
    however it is nested (`hub_token: {value: ...}` too)."""
    if key and is_secret_name(key) and node not in (None, "", {}, []) and not isinstance(node, bool):
        return MASK
    if isinstance(node, dict):
        return {name: redact(value, f"{key}.{name}" if key else str(name)) for name, value in node.items()}
    if isinstance(node, (list, tuple)):
        masked = [redact(item, key) for item in node]
        return type(node)(masked) if isinstance(node, tuple) else masked
    if isinstance(node, str):
        return redact_text(node)
    return node


def shown(key: str, value: Any) -> Any:
    """A value as it may be printed next to its key: masked when either says it is secret."""
    return redact(value, key)


def masked_item(item: str) -> str:
    """A typed FILE or KEY=VALUE item as it may be shown or kept: a secret's value never (as the
    cli layer's origin), credentials in a URL masked."""
    key, sep, _ = item.partition("=")
    return f"{key}=***" if sep and is_secret_name(key.strip()) else redact_text(item)
