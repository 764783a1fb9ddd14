"""Schemas people send as structured outputs and tool parameters: pydantic v2 models (nested models, $defs / $ref,
Optional, Literal / Enum, list[Model], dict[str, int], formats, constr / conint / confloat, tuples, discriminated
unions, a recursive tree), OpenAI's strict-mode examples from its docs, and common tools' parameters. Each is a
plain JSON schema, as a client sends it; the keywords structured outputs refuse (uniqueItems: a pydantic set) are
tested elsewhere."""

from __future__ import annotations

import datetime as dt
import uuid
from enum import Enum
from typing import Annotated, Literal

from pydantic import AnyUrl, BaseModel, Field, conint, constr


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=8)
    city: str = Field(min_length=1, max_length=8)
    zip: constr(pattern=r"^\d{5}(-\d{4})?$")


class Person(BaseModel):
    name: str = Field(min_length=2, max_length=6)
    age: conint(ge=0, le=130)
    email: Annotated[str, Field(json_schema_extra={"format": "email"})] | None = None  # EmailStr (no email-validator here)
    address: Address
    previous: list[Address] = Field(max_length=1)
    scores: dict[str, int] = Field(max_length=2)
    color: Color
    kind: Literal["staff", "guest"]


class Measures(BaseModel):
    ratio: float = Field(gt=0, le=0.5)
    share: Annotated[float, Field(ge=0, le=1)]
    price: Annotated[float, Field(multiple_of=0.25, ge=0, lt=10)]
    batch: Annotated[int, Field(multiple_of=5, ge=5, le=50)]
    offset: int = Field(gt=-3, lt=3)
    pair: tuple[int, bool]
    codes: list[constr(pattern=r"^[A-Z]{2}$")] = Field(min_length=1, max_length=3)


class Stamps(BaseModel):
    at: dt.datetime
    day: dt.date
    time: dt.time
    id: uuid.UUID
    link: AnyUrl


class Cat(BaseModel):
    pet_type: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    pet_type: Literal["dog"]
    good: bool


class Owner(BaseModel):
    pet: Cat | Dog = Field(discriminator="pet_type")
    spare: Cat | None = None


class Tree(BaseModel):
    value: int = Field(ge=0, le=9)
    children: list[Tree] = Field(max_length=2)


MATH = {"type": "object", "properties": {
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "explanation": {"type": "string"}, "output": {"type": "string"}},
        "required": ["explanation", "output"], "additionalProperties": False}},
    "final_answer": {"type": "string"}}, "required": ["steps", "final_answer"], "additionalProperties": False}
UI = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
    "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}},
    "attributes": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "value": {"type": "string"}},
        "required": ["name", "value"], "additionalProperties": False}}},
    "required": ["type", "label", "children", "attributes"], "additionalProperties": False}
LINKED_LIST = {"type": "object", "properties": {"linked_list": {"$ref": "#/$defs/node"}}, "$defs": {"node": {
    "type": "object", "properties": {"value": {"type": "number"},
                                     "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "additionalProperties": False, "required": ["next", "value"]}},
    "required": ["linked_list"], "additionalProperties": False}

WEATHER = {"type": "object", "properties": {
    "location": {"type": "string", "description": "City and country, e.g. Bogotá, Colombia"},
    "units": {"type": ["string", "null"], "enum": ["celsius", "fahrenheit", None]}},
    "required": ["location", "units"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "minLength": 1, "maxLength": 12},
    "num_results": {"type": "integer", "minimum": 1, "maximum": 10},
    "recency_days": {"type": "integer", "exclusiveMinimum": 0},
    "site": {"type": "string", "format": "hostname"}}, "required": ["query"]}
CALCULATOR = {"type": "object", "properties": {
    "expression": {"type": "string", "pattern": r"^[0-9+*/() .-]{1,12}$"},
    "precision": {"type": "integer", "enum": [0, 2, 4]}}, "required": ["expression"]}
SQL = {"type": "object", "properties": {
    "table": {"type": "string", "enum": ["orders", "customers"]},
    "columns": {"type": "array", "items": {"type": "string", "enum": ["id", "status", "amount"]}, "maxItems": 2},
    "conditions": {"type": "array", "maxItems": 1, "items": {"type": "object", "properties": {
        "column": {"type": "string", "maxLength": 6},
        "operator": {"type": "string", "enum": ["=", ">", "<", ">=", "<=", "!="]},
        "value": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "number"}, {"type": "null"}]}},
        "required": ["column", "operator", "value"], "additionalProperties": False}},
    "order_by": {"type": "string", "enum": ["asc", "desc"]}},
    "required": ["table", "columns", "conditions", "order_by"], "additionalProperties": False}
SEND_EMAIL = {"type": "object", "properties": {
    "to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1, "maxItems": 2},
    "when": {"type": "string", "format": "date-time"}, "id": {"type": "string", "format": "uuid"},
    "urgent": {"type": "boolean"}}, "required": ["to", "when", "id", "urgent"], "additionalProperties": False}

# name -> schema: every one is an object (a tool's parameters too)
SCHEMAS = {
    "person": Person.model_json_schema(), "measures": Measures.model_json_schema(),
    "stamps": Stamps.model_json_schema(), "owner": Owner.model_json_schema(), "tree": Tree.model_json_schema(),
    "math_reasoning": MATH, "ui": UI, "linked_list": LINKED_LIST,
    "get_weather": WEATHER, "web_search": SEARCH, "calculator": CALCULATOR, "sql_query": SQL,
    "send_email": SEND_EMAIL,
}
