"""Reason templates: text with {fact} or {fact:spec} holes, over facts only.

A template is parsed once at load time with string.Formatter().parse, and rendered by our own
loop, never by str.format on user text: a hole must name a fact exactly (no attribute access
`{a.b}`, no indexing `{a[0]}`, no positional `{}` or `{0}`, no conversion `!r`, no nested
`{a:{b}}`), and its format spec must match a small grammar with width and precision below 100
(so `{seq_len:999999999}` cannot allocate a gigabyte). A null fact renders as "unknown".
"""

from __future__ import annotations

import re
import string

from veloxquant_mlx.policy.facts import FACTS

_SPEC = re.compile(r"^(?:.?[<>=^])?[+\- ]?#?0?\d{0,2}[,_]?(?:\.\d{1,2})?[bcdeEfFgGnosxX%]?$")


class TemplateError(ValueError):
    """A reason template is not a template over facts; the message says why."""


def compile_template(text: str) -> tuple:
    """Parsed pieces: a tuple of (literal, fact_name or None, format_spec)."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise TemplateError(f"malformed template: {exc} (write {{{{ and }}}} for literal braces)") from None
    pieces = []
    for literal, field, spec, conversion in parsed:
        if field is None:
            pieces.append((literal, None, ""))
            continue
        if field == "" or field.isdigit():
            raise TemplateError("positional holes like {} or {0} are not allowed: name a fact, "
                                f"one of {', '.join(FACTS)}")
        if "." in field or "[" in field:
            raise TemplateError(f"{{{field}}}: attribute access and indexing are not allowed: "
                                f"a hole names a fact, one of {', '.join(FACTS)}")
        if field not in FACTS:
            raise TemplateError(f"{{{field}}}: unknown fact: allowed is one of {', '.join(FACTS)}")
        if conversion is not None:
            raise TemplateError(f"{{{field}!{conversion}}}: conversions are not allowed")
        spec = spec or ""
        if "{" in spec or "}" in spec or not _SPEC.match(spec):
            raise TemplateError(f"{{{field}:{spec}}}: format spec {spec!r} is not allowed: use a "
                                "plain spec like :d, :.2f, :.0%, :, with width and precision < 100")
        sample = FACTS[field].sample
        sample = int(sample) if FACTS[field].kind == "int" else float(sample)
        try:
            format(sample, spec)
        except (ValueError, TypeError) as exc:
            raise TemplateError(f"{{{field}:{spec}}}: format spec does not fit a {FACTS[field].kind} "
                                f"fact: {exc}") from None
        pieces.append((literal, field, spec))
    return tuple(pieces)


def render(pieces: tuple, facts: dict) -> str:
    out = []
    for literal, field, spec in pieces:
        out.append(literal)
        if field is not None:
            value = facts[field]
            if value is None:
                out.append("unknown")
            else:
                try:
                    out.append(format(value, spec))
                except (ValueError, TypeError):
                    # An int spec like :d on a fact that happens to be a float: show it plainly.
                    out.append(str(value))
    return "".join(out)


def template_facts(pieces: tuple) -> tuple:
    return tuple(dict.fromkeys(field for _, field, _ in pieces if field is not None))
