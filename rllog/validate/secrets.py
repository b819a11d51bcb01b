"""Secret redaction: credentials in configs, options, command lines and free text replaced before anything is
journaled or written to run.json. The rule is documented in docs/decisions.md ("Secrets"); tests/test_secrets.py
holds every spelling."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rllog.errors import InvalidValue
from rllog.validate.nesting import MAX_NESTING_DEPTH, _too_deep

REDACTED = "***REDACTED***"

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # "apiKey" -> api, Key; "HFToken" -> HF, Token; "api-keys" -> api, keys
# Named anywhere in a key (compared without case or separators), these are credentials.
_CREDENTIAL_STEM = re.compile(
    r"password|passwd|passphrase|secret|credential|authorization|cookie|webhook|apikey|privatekey|accesskey|authheader"
)
# "<qualifier> key(s)" ends the name of a credential; a bare "key" (a metric's key, a dataset key) is not one.
_KEY_QUALIFIERS = frozenset(
    "api private secret access signing encryption ssh client session master license hmac account service "
    "deploy gpg pgp auth".split()
)
# A key ending in "token" names a credential unless the word before it names a tokenizer's vocabulary token.
_VOCABULARY_TOKENS = frozenset(
    "pad eos bos unk sep cls mask image video audio vision boi eoi boa eoa start end stop eot eom eod think "
    "placeholder special sentinel prefix suffix middle turn tool answer system".split()
)
# "tokens" (plural) counts tokens (max_new_tokens, num_tokens) unless one of these qualifies it.
_TOKEN_QUALIFIERS = frozenset(
    "access refresh auth hub hf bearer session id api oauth github gh gitlab slack bot personal security secret csrf jwt".split()
)
_CREDENTIAL_WORDS = frozenset(("auth", "dsn", "jwt"))  # as the last word: `auth`, `http_auth`, `sentry_dsn`


@functools.lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    """Whether a config key names a credential: ``api-key``, ``apiKey``, ``hub_token``, ``headers/Authorization``...

    Ordinary names holding "token" are not: ``pad_token``, ``eos_token``, ``pad_token_id``, ``max_new_tokens``,
    ``include_num_input_tokens_seen``, ``tokenizer_name``.
    """
    words = [w.lower() for w in _WORD.findall(str(key))]
    if not words:
        return False
    if _CREDENTIAL_STEM.search("".join(words)):
        return True
    while len(words) > 1 and words[-1].isdigit():  # api_token_2
        words.pop()
    last, before = words[-1], (words[-2] if len(words) > 1 else "")
    if last in ("key", "keys"):
        return before in _KEY_QUALIFIERS
    if last.endswith("tokens"):
        return (last[:-6] or before) in _TOKEN_QUALIFIERS
    if last.endswith("token"):  # hub_token, hubToken, hubtoken, token
        return (last[:-5] or before) not in _VOCABULARY_TOKENS
    return last in _CREDENTIAL_WORDS


_TOKEN_SHAPES = (
    r"hf_[A-Za-z0-9]{30,}",  # Hugging Face user and organisation tokens
    r"api_org_[A-Za-z0-9]{30,}",
    r"sk-[A-Za-z0-9_\-]{20,}",  # OpenAI, Anthropic (sk-ant-...)
    r"gh[pousr]_[A-Za-z0-9]{30,}",  # GitHub, GitLab
    r"github_pat_[A-Za-z0-9_]{30,}",
    r"glpat-[A-Za-z0-9_\-]{20,}",
    r"xox[abposr]-[A-Za-z0-9\-]{10,}",  # Slack
    r"(?:AKIA|ASIA)[0-9A-Z]{16}",  # AWS access key id
    r"AIza[0-9A-Za-z_\-]{35}",  # Google API key
    r"[rs]k_(?:live|test)_[A-Za-z0-9]{16,}",  # Stripe
    r"npm_[A-Za-z0-9]{36}",
    r"pypi-[A-Za-z0-9_\-]{50,}",
    r"eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",  # a JWT
)
_TOKEN_SHAPE = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(_TOKEN_SHAPES) + ")")
_PRIVATE_KEY_BLOCK = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:]*:)[^\s/@]+(?=@)")  # keeps scheme://user: and @host
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic)(\s+)([A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE)
# name=value (URL queries, connection strings, reprs), --name value (command lines), "name": value (JSON, dict reprs)
_NAME_EQUALS = re.compile(r"""(?<![\w.\-])(-{0,2}[A-Za-z_][\w.\-]*)(\s*=\s*)("[^"]*"|'[^']*'|[^\s&;,)\]}'"]+)""")
_DASHED_OPTION = re.compile(r"(?<!\S)(--?[A-Za-z][\w.\-]*)(\s+)([^\s\-'\"][^\s'\"]*)")
_QUOTED_ITEM = re.compile(r"""(["'])([^"'\n]{1,200})\1(\s*:\s*)("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\[[^\]]*\]|-?\d[\w.+\-]*)""")


def _named_value(match: re.Match) -> str:
    name, between, value = match.group(1), match.group(2), match.group(3)
    if not is_secret_key(name.lstrip("-")):
        return match.group(0)
    quote = value[0] if value[0] in "'\"" and value[-1] == value[0] and len(value) > 1 else ""
    return f"{name}{between}{quote}{REDACTED}{quote}"


def _quoted_item(match: re.Match) -> str:
    quote, name, between, value = match.groups()
    if not is_secret_key(name):
        return match.group(0)
    around = value[0] if value[0] in "'\"" else quote  # a list or a number becomes a quoted string (JSON stays JSON)
    return f"{quote}{name}{quote}{between}{around}{REDACTED}{around}"


def _auth_scheme(match: re.Match) -> str:
    scheme, space, credential = match.groups()
    if scheme.lower() == "basic":  # base64 of "user:password"; "Basic training" is not one
        try:
            secret = b":" in base64.b64decode(credential, validate=True)
        except (binascii.Error, ValueError):
            secret = False
    else:  # "bearer of" / "Bearer authentication" in prose is not a credential
        secret = len(credential) >= 8 and not (credential.isalpha() and credential.islower())
    return f"{scheme}{space}{REDACTED}" if secret else match.group(0)


def redact_text(text: str) -> str:
    """``text`` with the credentials inside it replaced by ``***REDACTED***``: a URL's password
    (``https://user:***REDACTED***@host``), ``Bearer``/``Basic`` credentials, well-known token shapes
    (``hf_...``, ``sk-...``, ``ghp_...``, ``xoxb-...``, AWS and Google keys, JWTs, PEM private keys), and the
    value of ``name=value``, ``--name value`` and ``"name": value`` where ``name`` names a credential.
    """
    text = _PRIVATE_KEY_BLOCK.sub(REDACTED, text)
    text = _URL_PASSWORD.sub(lambda match: match.group(1) + REDACTED, text)
    text = _TOKEN_SHAPE.sub(REDACTED, text)
    text = _AUTH_SCHEME.sub(_auth_scheme, text)
    text = _NAME_EQUALS.sub(_named_value, text)
    text = _DASHED_OPTION.sub(_named_value, text)
    return _QUOTED_ITEM.sub(_quoted_item, text)


def redact_args(args: Sequence[str]) -> tuple[str, ...]:
    """Command-line arguments with credentials replaced: :func:`redact_text` on each, and the argument after an
    option that names a credential (``--hub_token VALUE``: two arguments, which :func:`redact_text` sees apart)."""
    out = [redact_text(str(a)) for a in args]
    for i in range(len(out) - 1):
        option = str(args[i])
        if (
            option.startswith("-")
            and "=" not in option
            and is_secret_key(option.lstrip("-"))
            and not str(args[i + 1]).startswith("-")
        ):
            out[i + 1] = REDACTED
    return tuple(out)


def _keeps_no_secret(value: Any) -> bool:
    """None, booleans (``use_auth_token=True``) and empty values hold no secret: kept even under a secret key."""
    return value is None or isinstance(value, bool) or (isinstance(value, (str, bytes, Mapping, list, tuple, set)) and not value)


def _as_mapping(config: Any) -> Mapping | None:
    """A config object's fields: a dataclass, a pydantic model or anything with ``to_dict()``; else None.

    Raises:
        InvalidValue: converting it recursed without end (``asdict`` of a dataclass that holds itself).
    """
    if isinstance(config, Mapping):
        return config
    try:
        if hasattr(config, "to_dict") and not isinstance(config, type):
            return config.to_dict()
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
        if hasattr(config, "model_dump") and not isinstance(config, type):  # pydantic (wandb.Settings)
            return config.model_dump()
    except RecursionError:
        raise InvalidValue(
            f"a {type(config).__name__} cannot be turned into a dict: it nests too deep or contains itself"
        ) from None
    return None


def redact(value: Any) -> Any:
    """A JSON-friendly deep copy of ``value`` (e.g. ``backend_options``) with every credential replaced by
    ``***REDACTED***``: the whole value under a key that names a credential (:func:`is_secret_key`; None,
    booleans and empty values are kept), and credentials inside any string (:func:`redact_text`).

    Mappings (and dataclasses, pydantic models, objects with ``to_dict()``) become dicts, sequences lists,
    bytes text; numbers and None are kept; other objects become their redacted ``str()``.

    Example:
        >>> redact({"wandb": {"settings": {"api_key": "k" * 40}, "project": "p"}})
        {'wandb': {'settings': {'api_key': '***REDACTED***'}, 'project': 'p'}}

    Raises:
        InvalidValue: ``value`` nests more than :data:`MAX_NESTING_DEPTH` levels, or contains itself.
    """
    return _redact(value, "", 1)


def _redact(value: Any, path: str, depth: int) -> Any:
    """:func:`redact` of ``value``, found at key path ``path`` (``a/b[0]``), ``depth`` levels down."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (bytes, bytearray)):
        return redact_text(bytes(value).decode("utf-8", "replace"))
    if depth > MAX_NESTING_DEPTH:
        raise InvalidValue(_too_deep(f"the value at {path!r}", value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_redact(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    mapping = _as_mapping(value)
    if mapping is not None:
        return {
            str(k): (v if _keeps_no_secret(v) else REDACTED)
            if is_secret_key(str(k))
            else _redact(v, f"{path}/{k}" if path else str(k), depth + 1)
            for k, v in mapping.items()
        }
    return redact_text(str(value))
