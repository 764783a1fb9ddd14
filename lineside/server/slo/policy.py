"""The SLO policy: thresholds per degradation level, recovery delay and backoff, time-window pins, where level-1
traffic goes and the response cache's bounds. Defaults are the seed report's numbers; a file overrides them.

Parsed strictly (unknown keys and out-of-order thresholds are errors) so a typo cannot silently disable a guard.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lineside.errors import LinesideError
from lineside.runtime.request import Mode, Priority
from lineside.server.slo.cache import DEFAULT_CACHE_MB


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would take it as 1 or 0; no setting here is a yes/no
            raise ValueError(f"{str(value).lower()} is not a number (YAML reads yes/no/on/off unquoted as true/"
                             "false); give a number")
        return value


class Thresholds(_Strict):
    """Entering a level when any set signal is above its threshold (None: that signal does not count)."""

    ttft_p90_s: float | None = Field(default=None, gt=0)
    queue_wait_p90_s: float | None = Field(default=None, gt=0)
    kv_usage: float | None = Field(default=None, gt=0, le=1)
    memory_ratio: float | None = Field(default=None, gt=0, le=1)
    gpu_load: float | None = Field(default=None, gt=0, le=1)


SIGNAL_NAMES = tuple(Thresholds.model_fields)


class Pin(_Strict):
    """Hold at least ``level`` between local times ``start`` and ``end`` (the seed's night-time switch; an
    interval past midnight, e.g. 22:00-06:00, wraps)."""

    start: dt.time
    end: dt.time
    level: int = Field(ge=0, le=2)

    @field_validator("start", "end", mode="before")
    @classmethod
    def _a_clock_time(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (str, dt.time)):
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # YAML 1.1 reads 22:00 unquoted as base 60: 1320
                digits, rest = [], value
                while True:
                    rest, d = divmod(rest, 60)
                    digits.append(d)
                    if not rest:
                        break
                shown = ":".join([str(digits[-1]), *(f"{d:02d}" for d in reversed(digits[:-1]))])
                raise ValueError(f'YAML read {shown} unquoted as the number {value}; quote it: "HH:MM"')
            raise ValueError(f'{value!r} is not a time of day; quote it: "HH:MM"')
        return value

    @field_validator("start", "end")
    @classmethod
    def _local(cls, value: dt.time) -> dt.time:
        if value.tzinfo is not None:
            raise ValueError("a local time has no zone (pins follow the server's local clock); give it as "
                             '"HH:MM"')
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> Pin:
        if self.start == self.end:
            raise ValueError(f"start and end are the same time ({self.start:%H:%M}): the pin would never hold; for "
                             'the whole day give start "00:00" and end "23:59:59"')
        return self

    def active(self, now: dt.time) -> bool:
        if self.start <= self.end:
            return self.start <= now < self.end
        return now >= self.start or now < self.end


class CachePolicy(_Strict):
    """The level-2 response cache: at most ``max_entries`` answers and ``max_mb`` MiB of their JSON, each for
    ``ttl_s`` seconds."""

    max_entries: int = Field(default=512, ge=1)
    max_mb: float = Field(default=DEFAULT_CACHE_MB, gt=0, description="MiB of the answers' JSON held at most")
    ttl_s: float = Field(default=300.0, gt=0)


class SloPolicy(_Strict):
    """Everything the controller and the router decide by."""

    level_1: Thresholds = Thresholds(ttft_p90_s=0.8, memory_ratio=0.85)
    level_2: Thresholds = Thresholds(ttft_p90_s=1.5)
    window_s: float = Field(default=60.0, gt=0, description="rolling window of the TTFT and queue-wait P90")
    min_samples: int = Field(default=5, ge=1, description="fewer TTFT samples in the window: no TTFT verdict")
    tick_s: float = Field(default=1.0, gt=0, description="how often the controller reads the signals")
    recover_after_s: float = Field(default=300.0, ge=0, description="signals below the thresholds this long: "
                                                                    "down one level")
    backoff_factor: float = Field(default=2.0, ge=1, description="recover_after multiplies by this on a flap")
    max_recover_after_s: float = Field(default=3600.0, gt=0)
    flap_window_s: float = Field(default=300.0, ge=0, description="escalating this soon after a recovery is a "
                                                                  "flap")
    batch_running_cap: int = Field(default=1, ge=0, description="batch requests running on the primary at level 1")
    fallback_modes: tuple[Mode, ...] = (Mode.BATCH,)
    fallback_priorities: tuple[Priority, ...] = (Priority.LOW,)
    pins: tuple[Pin, ...] = ()
    cache: CachePolicy = CachePolicy()

    @model_validator(mode="after")
    def _ordered(self) -> SloPolicy:
        if not self.pins and not any(getattr(level, name) is not None for level in (self.level_1, self.level_2)
                                     for name in SIGNAL_NAMES):
            raise ValueError(f"no level has a threshold and no pin is set: the guard would never degrade; give "
                             f"level_1 or level_2 a threshold ({', '.join(SIGNAL_NAMES)}) or a pin")
        for name in SIGNAL_NAMES:
            one, two = getattr(self.level_1, name), getattr(self.level_2, name)
            if one is not None and two is not None and not two > one:
                # a file giving one block meets the other's default: say so, it is not in the file to look at
                unset = next((key for key in ("level_1", "level_2") if key not in self.model_fields_set), None)
                hint = f" ({unset} is not in the file: its default block counts; give {unset} too)" if unset else ""
                raise ValueError(f"level_2.{name} ({two}) must be above level_1.{name} ({one}){hint}")
        if self.max_recover_after_s < self.recover_after_s:
            raise ValueError(f"max_recover_after_s ({self.max_recover_after_s}) must be at least recover_after_s "
                             f"({self.recover_after_s})")
        return self

    def pinned_level(self, now: dt.time) -> int:
        """The highest level a pin holds at local time ``now`` (0 when none is active)."""
        return max((pin.level for pin in self.pins if pin.active(now)), default=0)


def load_policy(path: str | Path) -> SloPolicy:
    """A policy from a YAML or JSON file; any problem is one LinesideError line naming the file and the key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # Windows editors start a file with a BOM; json.loads refuses it
    except OSError as e:
        raise LinesideError(f"--slo-policy {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise LinesideError(f"--slo-policy {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                            "UTF-8") from None
    import yaml

    from lineside.yaml_keys import DuplicateKey, load_unique  # (yaml: imported only when a policy is read)

    is_json = path.suffix.lower() == ".json"
    try:
        data = json.loads(text, object_pairs_hook=_once) if is_json else load_unique(text)
    except (_Repeated, DuplicateKey) as e:
        raise LinesideError(f"--slo-policy {path}: key {e} is written twice; only the last would count: remove one "
                            "or merge them") from None
    except json.JSONDecodeError as e:
        raise LinesideError(f"--slo-policy {path}: not valid JSON at line {e.lineno} ({e.msg}); fix the syntax, or "
                            "name the file .yaml if it is YAML") from None
    except yaml.YAMLError as e:  # the problem and its line: "while scanning for the next token" said neither
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        hint = "; indent with spaces, not tabs" if "'\\t'" in problem else "; fix the syntax"
        raise LinesideError(f"--slo-policy {path}: not valid YAML{at} ({problem}){hint}") from None
    return parse_policy({} if data is None else data, source=str(path))  # an empty file: the defaults


class _Repeated(Exception):
    """A key written twice in one mapping (JSON and YAML keep the last without a word)."""


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    repeated = next((k for k in keys if keys.count(k) > 1), None)
    if repeated is not None:
        raise _Repeated(repr(repeated))
    return dict(pairs)


def parse_policy(data: Any, *, source: str = "policy") -> SloPolicy:
    if not isinstance(data, dict):
        raise LinesideError(f"--slo-policy {source}: the top level must be a mapping of settings")
    try:
        return SloPolicy.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        where = _where(error["loc"]) or "thresholds"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            known = _known_keys(error["loc"])
            message = f"unknown key; known keys here: {', '.join(known)}"
        elif error["type"] in _SHAPES:  # pydantic's "a valid tuple" / "instance of Thresholds" is Python talk
            message = f"{_SHAPES[error['type']]}; got {error.get('input')!r}"
        raise LinesideError(f"--slo-policy {source}: {where}: {message}") from None


_SHAPES = {
    "tuple_type": "give a list (- item lines, or [a, b])",
    "list_type": "give a list (- item lines, or [a, b])",
    "dict_type": "give a mapping of keys (key: value lines)",
    "model_type": "give a mapping of keys (key: value lines)",
}


def _where(loc: tuple) -> str:
    """``pins[0].start``: the key's path as the fleet file's errors and the docs write it."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _known_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = SloPolicy
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        elif part == "pins" or isinstance(part, int):
            model = Pin
    return list(model.model_fields)
