"""Schemas and prompts for the structured-output client tests and benchmark (SmolLM2-sized tasks):
nested objects, arrays, enums, bounded numbers, optional fields."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field


class Defect(str, Enum):
    scratch = "scratch"
    dent = "dent"
    crack = "crack"
    porosity = "porosity"
    misalignment = "misalignment"


class DefectReport(BaseModel):
    """A defect seen on the line."""

    defect: Defect
    station: str = Field(max_length=12, description="station id such as ST-07")
    severity: int = Field(ge=1, le=5, description="1 (cosmetic) to 5 (stop the line)")
    action: str = Field(max_length=60)
    notes: str | None = Field(default=None, max_length=40)


class Location(BaseModel):
    line: int = Field(ge=1, le=9)
    station: str = Field(max_length=12)


class Part(BaseModel):
    name: str = Field(max_length=24)
    quantity: int = Field(ge=0, le=1000)


class Stoppage(BaseModel):
    """A line stoppage with where it happened and the parts it needs."""

    where: Location
    minutes: float = Field(ge=0, le=480)
    parts: list[Part] = Field(max_length=3)
    cause: str = Field(max_length=40)


class Reading(BaseModel):
    sensor: str = Field(max_length=20)
    value: float = Field(ge=-50, le=150)
    unit: str = Field(max_length=6)
    ok: bool


DEFECT_TEXTS = [
    "ST-07 press: crack in the upper die, stop and replace the die before the next shift.",
    "Station ST-12 welding robot: porosity in seam 4. Re-weld and check the gas flow.",
    "ST-03 paint booth: small scratch on the left door panel, polish it.",
    "Line 2, ST-21: misalignment of the bracket, adjust the fixture. Severity high.",
    "ST-09: dent in the hood after the press; send the part to rework.",
    "ST-15 assembly: scratch on the bumper, cosmetic only, note it in the log.",
    "ST-02 casting: porosity found in housing 17, scrap it and check the mould temperature.",
    "ST-30: crack in a weld on the frame, severity 5, stop the line now.",
    "ST-11 glass fitting: misalignment of the windscreen by 3 mm, refit it.",
    "ST-04: dent on the roof from a dropped tool, repair the panel.",
]
STOPPAGE_TEXTS = [
    "Line 3 stopped at ST-08 for 25 minutes: a conveyor belt tore. Needed 1 belt and 4 bolts.",
    "ST-14 on line 1 was down 12.5 minutes because the robot gripper failed; 2 grippers used.",
    "Line 5, station ST-22: 40 minutes lost to a jammed feeder, replaced 1 feeder motor.",
    "Line 2 ST-05 stopped 8 minutes for a sensor fault; swapped 1 proximity sensor.",
    "Line 7, ST-31: hydraulic leak, 90 minutes, used 3 seals and 1 hose.",
]
READING_TEXTS = [
    "Oven zone 2 temperature reads 182 C, above the 150 C limit.",
    "Coolant pump pressure 3.2 bar, normal.",
    "Spindle vibration 4.1 mm/s, within limits.",
    "Hall humidity 55 %, fine.",
    "Motor M4 current 12 A, normal range.",
]

# (model, texts, instruction): the instruction names the fields, as an app's prompt would
CASES = [
    (DefectReport, DEFECT_TEXTS, "Extract the defect report (defect, station, severity 1-5, action, notes) as JSON"),
    (Stoppage, STOPPAGE_TEXTS, "Extract the stoppage (where: line and station, minutes, parts, cause) as JSON"),
    (Reading, READING_TEXTS, "Extract the sensor reading (sensor, value, unit, ok) as JSON"),
]


def prompts(limit_per_case: int | None = None):
    """(model, prompt) pairs: every case's texts, ``limit_per_case`` of each when given."""
    out = []
    for model, texts, instruction in CASES:
        for t in texts[:limit_per_case]:
            out.append((model, f"{instruction}: {t}"))
    return out
