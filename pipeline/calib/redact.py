"""PII redaction, applied before anything else looks at the text: e-mails (internationalised ones,
and spelled-out ones such as "john dot smith at example dot com" or "jane [at] mail [dot] com"),
phones, card numbers (13-19 digits with a card issuer's first digits, solid or grouped; whether or not they pass
the Luhn check: a card number mistyped by one digit is still the customer's card), IBANs (mod 97; grouped by
spaces or hyphens), IPv4 and IPv6 addresses, and user patterns from calib.redact_patterns.
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


def _iban_ok(candidate: str) -> bool:
    s = candidate.replace(" ", "").replace("-", "").upper()
    if not 15 <= len(s) <= 34 or s[:2] not in IBAN_COUNTRIES:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _card_ok(candidate: str) -> bool:
    """Card-like: 13-19 digits starting as an issuer's do. No Luhn check: one that fails it (mistyped, or a number
    made up to look like a card) is redacted too."""
    digits = re.sub(r"\D", "", candidate)
    issuer = digits[0] in "3456" or "2221" <= digits[:4] <= "2720" or digits[:2] in ("81", "82")
    return 13 <= len(digits) <= 19 and issuer


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
    space or hyphen (a card followed by its CVV, an IBAN followed by a capitalised word). after_id_label_ok
    False: a bare number right after 'order #', 'tracking no.' and the like is an identifier."""
    def check(candidate: str, text: str, start: int) -> int:
        if not after_id_label_ok and not candidate.startswith("+") and _after_id_label(text, start):
            return 0
        ends = [len(candidate)]
        if cut_at_spaces:
            ends += [i for i in range(len(candidate) - 1, 0, -1) if candidate[i] in " -"]
        return next((end for end in ends if is_valid(candidate[:end])), 0)
    return check


# Combining marks, which Python's \w leaves out although they are part of a word: Latin, Cyrillic,
# Hebrew and Arabic diacritics, the Indic scripts' vowel signs (राम is र + ा + म), Thai, Lao, Myanmar,
# Khmer, and the zero-width joiners.
MARKS = ("\u0300-\u036f\u0483-\u0489\u0591-\u05c7\u0610-\u061a\u064b-\u065f\u0900-\u0dff"
         "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u200c\u200d")

# Spelled-out e-mails: "john dot smith at example dot com", "jane [at] mail [dot] co [dot] uk",
# "first.last at example.com". Labels and repeats are bounded, so a search stays linear in the text.
_LABEL = r"[^\W_][\w-]{0,63}"
_AT = r"(?:\s{0,3}[\[({<]\s{0,2}at\s{0,2}[\])}>]\s{0,3}|\s{1,3}at\s{1,3})"
_DOT = r"(?:\s{0,3}[\[({<]\s{0,2}dot\s{0,2}[\])}>]\s{0,3}|\s{1,3}dot\s{1,3}|\.)"
SPELLED_EMAIL = re.compile(rf"(?<![\w.@-])(?P<local>{_LABEL}(?:{_DOT}{_LABEL}){{0,4}}){_AT}"
                           rf"(?P<domain>{_LABEL}(?:{_DOT}{_LABEL}){{1,4}})(?![\w@])", re.IGNORECASE)
SPELLED_DOT = re.compile(r"[\[({<]\s*dot\s*[\])}>]|\sdot\s", re.IGNORECASE)
BRACKETED_AT = re.compile(r"[\[({<]\s*at\s*[\])}>]", re.IGNORECASE)
# Top-level domains a spelled-out address may end in ("... dot com"): common ones only, so that
# "look at it dot by dot" stays; two-letter country codes also after co/com/org/net/gov/ac/edu.
SPELLED_TLDS = frozenset(
    "com net org edu gov mil info biz io ai app dev me co uk de fr es it nl be ch at se no dk fi pl pt ie ru ua "
    "cn jp kr tw hk sg my id th vn ph au nz ca mx br ar cl za ng ke eg ae sa tr il gr cz hu ro eu".split()
)
SECOND_LEVEL = frozenset("co com org net gov ac edu".split())


def _spelled_email_ok(candidate: str, text: str, start: int) -> int:
    """A spelled-out address counts when the spelling says so: a bracketed [at], a spelled dot in the
    domain, or a dotted name before a plain " at " ("first.last at example.com"), and it ends in a
    real-looking top-level domain."""
    match = SPELLED_EMAIL.fullmatch(candidate)
    if match is None:
        return 0
    local, domain = match["local"], match["domain"]
    labels = [label.lower() for label in re.split(_DOT, domain, flags=re.IGNORECASE)]
    tld = labels[-1]
    if not tld.isalpha() or len(tld) < 2:
        return 0
    spelled = SPELLED_DOT.search(domain) is not None
    if BRACKETED_AT.search(candidate) is None and not spelled and re.search(_DOT, local, re.IGNORECASE) is None:
        return 0  # "look at example.com": a plain phrase, not an address
    if (spelled or BRACKETED_AT.search(candidate)) and tld not in SPELLED_TLDS \
            and not (len(tld) == 2 and len(labels) >= 3 and labels[-2] in SECOND_LEVEL):
        return 0
    return len(candidate)


@dataclass(frozen=True)
class Redactor:
    kind: str
    pattern: re.Pattern
    check: Callable[[str, str, int], int]  # (candidate, text, start) -> characters to redact
    needs: str  # a key of PRE_CHECKS: a cheap test that skips texts that cannot match
    retry_inside: bool = False  # after a rejected candidate, search again from its next character


REDACTORS = [
    # any script in the name and the domain (RFC 6531), an IDN top-level domain or its xn-- form
    # (the look-behind starts a try only where a run of name characters starts: linear, not quadratic,
    # in a long word such as a pasted base64 blob)
    Redactor("email", re.compile(rf"(?<![\w{MARKS}.%+-])[\w{MARKS}.%+-]+@[\w{MARKS}-]+(?:\.[\w{MARKS}-]+)*\."
                                 rf"(?:[^\W\d_](?:[^\W\d_]|[{MARKS}])+|xn--[a-z0-9-]{{2,}})(?![\w{MARKS}-])"),
             lambda candidate, text, start: len(candidate), "at sign"),
    Redactor("email", SPELLED_EMAIL, _spelled_email_ok, "spelled at", retry_inside=True),
    Redactor("iban", re.compile(r"\b[A-Za-z]{2}\d{2}(?:[ -]?[A-Za-z0-9]{4}){2,7}(?:[ -]?[A-Za-z0-9]{1,4})?\b"),
             _checked(_iban_ok, cut_at_spaces=True), "long number"),
    # cards: 13-19 digits, solid or in groups (4-4-4-4[-3], Amex 4-6-5, Diners 4-6-4); issuer checked, not Luhn
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
    # " at " or "[at]", then a word and a dot or "dot": every spelled-out address has one
    "spelled at": re.compile(r"[\s\[({<][aA][tT][\s\])}>]\s{0,3}[^\W_][\w-]{0,63}(?:\.|\s{0,3}[\[({<]?\s{0,2}[dD][oO][tT]\b)").search,
    "long number": re.compile(r"\d[\d ().+/-]{6,}\d").search,  # every IBAN, card and phone has one
    "dotted number": re.compile(r"\d\.\d").search,
    "hex colon": re.compile(r"[0-9A-Fa-f]:[0-9A-Fa-f:]|::").search,
}


def _redact_kind(text: str, redactor: Redactor, counts: collections.Counter) -> str:
    pieces, copied, position = [], 0, 0
    while (match := redactor.pattern.search(text, position)) is not None:
        length = redactor.check(match.group(0), text, match.start())
        if not length:
            position = match.start() + 1 if redactor.retry_inside else max(match.end(), match.start() + 1)
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
