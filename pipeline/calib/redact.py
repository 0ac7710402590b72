"""PII redaction, applied before anything else looks at the text: e-mails, phones, Luhn-valid
cards, IBANs (mod 97), IPv4 and IPv6 addresses, and user patterns from calib.redact_patterns.
Each kind is a loose candidate pattern plus a check of the candidate; bare numbers right after an
order, tracking or similar label are identifiers and stay.
"""

from __future__ import annotations

import collections
import ipaddress
import re
from dataclasses import dataclass
from typing import Callable

# ---------------------------------------------------------------- redaction
#
# Each kind is a loose candidate pattern plus a check that says how much of the candidate to
# redact (0: none, and the search goes on after the candidate, as re.sub would).

IBAN_COUNTRIES = frozenset(
    "AD AE AL AT AZ BA BE BG BH BI BR BY CH CR CY CZ DE DJ DK DO EE EG ES FI FK FO FR GB GE GI GL GR GT HN HR "
    "HU IE IL IQ IS IT JO KW KZ LB LC LI LT LU LV LY MC MD ME MK MN MR MT MU NI NL NO OM PK PL PS PT QA RO RS "
    "RU SA SC SD SE SI SK SM SO ST SV TL TN TR UA VA VG XK YE".split()
)
# An order, tracking or transaction label right before a bare number: an identifier, not a phone or card.
ID_LABEL = re.compile(
    r"\b(?:order|tracking|transaction|txn|ref|reference|invoice|awb|arn|utr|imei|serial|ticket|complaint"
    r"|pnr|booking|shipment|consignment|sku|asin|isbn)\W{0,3}(?:(?:id|no|num|number|code|is|was)\b\W{0,3}){0,3}$",
    re.IGNORECASE,
)


def _luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = int(ch)
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _iban_ok(candidate: str) -> bool:
    s = candidate.replace(" ", "").upper()
    if not 15 <= len(s) <= 34 or s[:2] not in IBAN_COUNTRIES:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _card_ok(candidate: str) -> bool:
    digits = re.sub(r"\D", "", candidate)
    issuer = digits[0] in "3456" or "2221" <= digits[:4] <= "2720" or digits[:2] in ("81", "82")
    return 13 <= len(digits) <= 19 and issuer and _luhn_ok(digits)


def _phone_ok(candidate: str) -> bool:
    digits = sum(ch.isdigit() for ch in candidate)
    international = candidate.startswith(("+", "00"))
    return (8 if international else 9) <= digits <= 15


def _ipv6_ok(candidate: str) -> bool:
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return sum(1 for group in candidate.split(":") if group) >= 2  # "::1" and "::" name no one


def _ipv4_ok(candidate: str) -> bool:
    return all(int(octet) <= 255 for octet in candidate.split("."))


def _after_id_label(text: str, start: int) -> bool:
    return ID_LABEL.search(text, max(0, start - 40), start) is not None


def _checked(is_valid: Callable[[str], bool], *, cut_at_spaces: bool = False, after_id_label_ok: bool = True):
    """A check for one kind. cut_at_spaces: also try the candidate's prefixes that end before a
    space (a card followed by its CVV, an IBAN followed by a capitalised word). after_id_label_ok
    False: a bare number right after 'order #', 'tracking no.' and the like is an identifier."""
    def check(candidate: str, text: str, start: int) -> int:
        if not after_id_label_ok and not candidate.startswith("+") and _after_id_label(text, start):
            return 0
        ends = [len(candidate)]
        if cut_at_spaces:
            ends += [i for i in range(len(candidate) - 1, 0, -1) if candidate[i] == " "]
        return next((end for end in ends if is_valid(candidate[:end])), 0)
    return check


@dataclass(frozen=True)
class Redactor:
    kind: str
    pattern: re.Pattern
    check: Callable[[str, str, int], int]  # (candidate, text, start) -> characters to redact
    needs: str  # a key of PRE_CHECKS: a cheap test that skips texts that cannot match


REDACTORS = [
    Redactor("email", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
             lambda candidate, text, start: len(candidate), "at sign"),
    Redactor("iban", re.compile(r"\b[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]{4}){2,7}(?: ?[A-Za-z0-9]{1,4})?\b"),
             _checked(_iban_ok, cut_at_spaces=True), "long number"),
    # cards: 13-19 digits, solid or in groups (4-4-4-4[-3], Amex 4-6-5, Diners 4-6-4); Luhn and issuer checked
    Redactor("card", re.compile(r"(?<![\w-])(?:\d{13,19}|\d{4}(?:[ -]\d{4}){2,3}(?:[ -]\d{1,4})?|\d{4}[ -]\d{6}[ -]\d{4,5})"
                                r"(?!\w|-\d)"),
             _checked(_card_ok, cut_at_spaces=True, after_id_label_ok=False), "long number"),
    Redactor("ip", re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|\d{1,3}(?:\.\d{1,3}){3})?"
                              r"(?![\w:]|\.\d)"), _checked(_ipv6_ok), "hex colon"),
    Redactor("ip", re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w|\.\d)"), _checked(_ipv4_ok), "dotted number"),
    # phones: 8-15 digits (9+ without a country code) in up to six groups, optionally +CC and (area);
    # never the continuation of a longer number such as order #502-2345678-9012345 or a date
    Redactor("phone", re.compile(r"(?<![\w#+])(?<!\d[-/.])(?:(?:\+|\b00)\d{1,3}[ .-]?)?(?:\(\d{1,5}\)[ .-]?)?"
                                 r"\d{1,5}(?:[ .-]?\d{1,5}){0,5}(?!\w|[-/.]\d)"),
             _checked(_phone_ok, after_id_label_ok=False), "long number"),
]
PRE_CHECKS: dict[str, Callable[[str], object]] = {
    "at sign": lambda text: "@" in text,
    "long number": re.compile(r"\d[\d ().+/-]{6,}\d").search,  # every IBAN, card and phone has one
    "dotted number": re.compile(r"\d\.\d").search,
    "hex colon": re.compile(r"[0-9A-Fa-f]:[0-9A-Fa-f:]|::").search,
}


def _redact_kind(text: str, redactor: Redactor, counts: collections.Counter) -> str:
    pieces, copied, position = [], 0, 0
    while (match := redactor.pattern.search(text, position)) is not None:
        length = redactor.check(match.group(0), text, match.start())
        if not length:
            position = max(match.end(), match.start() + 1)
            continue
        pieces += [text[copied:match.start()], f"[{redactor.kind.upper()}]"]
        copied = position = match.start() + length
        counts[redactor.kind] += 1
    return "".join(pieces) + text[copied:] if pieces else text


def redact(text: str, counts: collections.Counter, extra: list[re.Pattern]) -> str:
    """Replaces personal data by [EMAIL], [PHONE], [CARD], [IBAN], [IP] and user patterns by [REDACTED]."""
    for pattern in extra:
        text, n = pattern.subn("[REDACTED]", text)
        counts["custom"] += n
    possible: dict[str, bool] = {}
    for redactor in REDACTORS:
        if redactor.needs not in possible:
            possible[redactor.needs] = bool(PRE_CHECKS[redactor.needs](text))
        if possible[redactor.needs]:
            text = _redact_kind(text, redactor, counts)
    return text
