"""Whether an OpenAI-compatible server serves the model asked for: its `/v1/models` list before the first request
(`check_listed`), and the `model` every reply names (`check_reply`). A server that answers as another model (a port
that now serves something else, a proxy routing to a fallback) would have its answers scored as the model asked for;
instead the stage stops with WrongModel, a UserError naming both.

A reply may name a dated snapshot of the model asked for (OpenAI's `gpt-4o` answers as `gpt-4o-2024-08-06`): the
name asked for followed by `-YYYY-MM-DD` or `-MMDD` is the same model; any other name is not. A server whose reply
names no model, or that has no /v1/models (HTTP 404), is not checked on that point; one it cannot be reached at is
left to the requests, which say so."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from pipeline.errors import UserError, cut

SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{4})")  # what a dated snapshot adds to the name asked for
MAX_LISTED_BYTES = 1 << 20
SHOWN_NAMES = 5


class WrongModel(UserError):
    """The server serves, or answered as, another model than the one asked for."""


def same_model(asked: str, named: str) -> bool:
    return named == asked or (named.startswith(asked) and SNAPSHOT.fullmatch(named[len(asked):]) is not None)


def _shown(name) -> str:
    return repr(cut(str(name), 120))  # a name too long for a message: cut at a word where it has one (errors.cut)


def _fix(section: str) -> str:
    return (f"point {section}.base_url at a server of {section}.model, or set {section}.model to the model that "
            "server serves; no result of this run was kept from it")


def check_reply(data, asked: str, base_url: str, section: str = "engine") -> None:
    """A reply (or streamed chunk) naming another model than `asked` is a WrongModel."""
    named = data.get("model") if isinstance(data, dict) else None
    if named is None or (isinstance(named, str) and same_model(asked, named)):
        return
    raise WrongModel(f"{base_url} answered as the model {_shown(named)}, not the model asked for, {_shown(asked)} "
                     f"({section}.model); {_fix(section)}")


def check_listed(base_url: str, asked: str, headers: dict, timeout: float, section: str = "engine",
                 redact=lambda text: text) -> None:
    """The server's /v1/models must list `asked` (or a dated snapshot of it): else WrongModel naming what it serves."""
    request = urllib.request.Request(base_url.rstrip("/") + "/models", headers=headers)
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as the requests: no proxy
        with opener.open(request, timeout=min(timeout, 30.0)) as answer:
            data = json.loads(answer.read(MAX_LISTED_BYTES))
    except (urllib.error.URLError, OSError, ValueError):  # unreachable, no /v1/models, not JSON: left to the requests
        return
    listed = data.get("data") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        return
    names = [entry.get("id") for entry in listed if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
    if not names or any(same_model(asked, name) for name in names):
        return
    served = ", ".join(_shown(n) for n in names[:SHOWN_NAMES]) + (f" and {len(names) - SHOWN_NAMES} more"
                                                                   if len(names) > SHOWN_NAMES else "")
    raise WrongModel(redact(f"{base_url} serves {served} (its /v1/models), not the model asked for, {_shown(asked)} "
                            f"({section}.model); {_fix(section)}"))
