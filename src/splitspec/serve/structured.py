"""The grammar a reply must follow: OpenAI's ``response_format`` or vLLM's ``structured_outputs``.

``response_format`` ``json_object`` / ``json_schema`` become a JSON-schema grammar. ``structured_outputs``
compiles through llguidance as vLLM's ``guidance`` backend compiles it: ``json`` (a schema, or its JSON text)
and ``json_object`` as ``response_format``'s, ``regex`` a regex (Rust's syntax) the whole reply matches,
``choice`` one of its strings, ``grammar`` a Lark grammar or llama.cpp's GBNF. JSON is laid out as json.dumps
writes it either way. A request sends one of the two (both: 400); what llguidance refuses is a 400 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from splitspec.decoding.grammar import GrammarCompiler
from splitspec.exceptions import InvalidGrammar
from splitspec.serve.errors import invalid
from splitspec.serve.schemas import GenerationRequest, JsonObjectFormat, JsonSchemaResponseFormat, StructuredOutputs


def output_param(body: GenerationRequest) -> str | None:
    """The field that constrains the reply's form, if any; 400 when both are sent."""
    fmt = isinstance(body.response_format, JsonObjectFormat | JsonSchemaResponseFormat)
    if fmt and body.structured_outputs is not None:
        raise invalid("send one of response_format and structured_outputs, not both", "structured_outputs")
    return "response_format" if fmt else "structured_outputs" if body.structured_outputs is not None else None


def output_grammar(body: GenerationRequest, compiler: Callable[[], GrammarCompiler]) -> str | None:
    """The grammar of ``response_format`` or ``structured_outputs``; None when the reply's form is free."""
    fmt, structured = body.response_format, body.structured_outputs
    if isinstance(fmt, JsonObjectFormat | JsonSchemaResponseFormat):
        output_param(body)
        return response_grammar(fmt, compiler)
    return None if structured is None else structured_grammar(structured, compiler)


def response_grammar(fmt: JsonObjectFormat | JsonSchemaResponseFormat, compiler: Callable[[], GrammarCompiler]) -> str:
    """The grammar of a ``response_format``; 400 naming it for a schema llguidance refuses."""
    if isinstance(fmt, JsonObjectFormat):
        return checked(lambda: compiler().json_schema({"type": "object"}), "response_format")
    schema = fmt.json_schema.schema_
    if schema is None:
        schema = {}
    what = f"response_format.json_schema.schema ({fmt.json_schema.name})"
    return checked(lambda: compiler().json_schema(schema, what), "response_format")


def structured_grammar(spec: StructuredOutputs, compiler: Callable[[], GrammarCompiler]) -> str:
    """The grammar of vLLM's ``structured_outputs`` (exactly one constraint, as its schema checked)."""
    param = "structured_outputs"
    (kind,) = spec.kinds()
    what = f"structured_outputs.{kind}"
    if kind == "json_object":
        return checked(lambda: compiler().json_schema({"type": "object"}, what), param)
    if kind == "json":
        schema = spec.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise invalid(f"{what} is not JSON: {exc}", param, code="invalid_schema") from None
        if not isinstance(schema, dict):
            raise invalid(f"{what} is not a JSON schema (an object)", param, code="invalid_schema")
        document: dict[str, object] = schema
        return checked(lambda: compiler().json_schema(document, what), param)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice or [])
        return checked(lambda: compiler().lark(lark, what), param)
    if kind == "regex":
        lark = f"start: /{llguidance.regex_to_lark(spec.regex or '')}/"
        return checked(lambda: compiler().lark(lark, what), param)
    return checked(lambda: compiler().lark(_lark(spec.grammar or "", what), what), param)


def _lark(text: str, what: str) -> str:
    """A Lark grammar as it is, GBNF converted (as llguidance's ``grammar_from("grammar", ...)``)."""
    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter's own GbnfToLarkError, and whatever a malformed text trips
        raise InvalidGrammar(f"{what} is neither Lark nor GBNF: {exc}") from None


def checked(build: Callable[[], str], param: str) -> str:
    """``build()``, a grammar; 400 naming ``param`` for one llguidance refuses."""
    try:
        return build()
    except InvalidGrammar as exc:
        raise invalid(str(exc), param, code="invalid_schema") from None
