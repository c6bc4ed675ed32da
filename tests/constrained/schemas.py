"""The JSON schemas of the structured-output tests (random walks and end-to-end), and jsonschema's format
checker adjusted to what xgrammar enforces."""

from __future__ import annotations

import copy
import datetime
import re

import jsonschema

SHORT = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, dict] = {
    "flat_object": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120}},
                    "required": ["name", "age"]},
    "nested_object": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": SHORT,
            "address": {"type": "object", "properties": {
                "city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
            "required": ["name", "address"]}},
        "required": ["person"]},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "object", "properties": {
            "d": {"type": "integer"}}, "required": ["d"]}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "int_array_bounds": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                         "minItems": 2, "maxItems": 4},
    "array_of_objects": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}},
        "required": ["id", "tags"]}},
    "nested_arrays": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "string_enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": [1, "two", None, True]},
    "const": {"type": "object", "properties": {"version": {"const": "v1"}, "n": {"type": "integer"}},
              "required": ["version", "n"]},
    "number_bounds": {"type": "number", "minimum": -10.5, "maximum": 10.5},
    "integer_exclusive": {"type": "object", "properties": {
        "x": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
        "y": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x", "y"]},
    "required_and_optional": {"type": "object", "properties": {
        "id": {"type": "integer"}, "nick": SHORT, "vip": {"type": "boolean"}, "note": SHORT},
        "required": ["id", "vip"]},
    "string_pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    "string_length": {"type": "string", "minLength": 2, "maxLength": 5},
    "format_date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                    "required": ["day"]},
    # xgrammar ignores minLength/maxLength next to a format (it warns), so none is given here.
    "format_email": {"type": "string", "format": "email"},
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "nullable": {"type": "object", "properties": {"v": {"type": ["integer", "null"]}}, "required": ["v"]},
    "any_of": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
         "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
         "required": ["kind", "side"]}]},
    "one_of_disjoint": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                  "y": {"type": "integer"}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
             "required": ["from", "to"]},
    "tuple_prefix_items": {"type": "array", "prefixItems": [SHORT, {"type": "integer"}, {"type": "boolean"}],
                           "items": False},
    "additional_properties_typed": {"type": "object", "additionalProperties": {"type": "integer"},
                                    "propertyNames": {"maxLength": 4}, "maxProperties": 3},
    "no_additional_properties": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                 "additionalProperties": False},
}

# jsonschema's format checks, adjusted to what xgrammar enforces (a documented limitation):
#  - date: xgrammar checks the shape YYYY-MM-DD with month 01-12 and day 01-31, not the calendar
#    (it allows 2023-02-31), so the check here is that shape;
#  - ipv4: xgrammar allows leading zeros in an octet (010.1.1.1), which Python's ipaddress rejects;
#  - date-time: jsonschema only checks it with the optional rfc3339-validator package, so check here.
FORMAT_CHECKER = copy.deepcopy(jsonschema.Draft202012Validator.FORMAT_CHECKER)
_DATE = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
_OCTET = r"0*(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"{_OCTET}(\.{_OCTET}){{3}}")


@FORMAT_CHECKER.checks("date")
def _is_date_shape(value: object) -> bool:
    return not isinstance(value, str) or _DATE.fullmatch(value) is not None


@FORMAT_CHECKER.checks("ipv4")
def _is_ipv4(value: object) -> bool:
    return not isinstance(value, str) or _IPV4.fullmatch(value) is not None


@FORMAT_CHECKER.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    # RFC 3339 date-times carry an offset (Z or +hh:mm) and allow a leap second (:60), which Python rejects.
    if not isinstance(value, str):
        return True
    value = re.sub(r"(T\d\d:\d\d):60", r"\1:59", value)
    return datetime.datetime.fromisoformat(value).tzinfo is not None
