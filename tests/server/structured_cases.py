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
    "ST-18 stamping: crack along the edge of the side panel, quarantine the batch.",
    "Station ST-25 coating line: porosity in the powder coat on three frames, recoat them.",
    "ST-06 trim: scratch on the dashboard, minor, buff it out.",
    "ST-27 drilling: misalignment of the hole pattern by 2 mm, recalibrate the jig.",
    "ST-13 body shop: dent in the rear quarter panel, pull it and refinish.",
    "ST-35 casting: crack in the engine block, severity 5, stop the casting cell.",
    "ST-08 polishing: scratch across the chrome trim, replace the trim.",
]
STOPPAGE_TEXTS = [
    "Line 3 stopped at ST-08 for 25 minutes: a conveyor belt tore. Needed 1 belt and 4 bolts.",
    "ST-14 on line 1 was down 12.5 minutes because the robot gripper failed; 2 grippers used.",
    "Line 5, station ST-22: 40 minutes lost to a jammed feeder, replaced 1 feeder motor.",
    "Line 2 ST-05 stopped 8 minutes for a sensor fault; swapped 1 proximity sensor.",
    "Line 7, ST-31: hydraulic leak, 90 minutes, used 3 seals and 1 hose.",
    "Line 4 halted at ST-19 for 30 minutes after a power dip; reset 2 drives.",
    "Line 1, ST-02: 18 minutes lost to a broken chain, fitted 1 chain.",
    "ST-26 on line 6 stopped 45 minutes: the vision camera failed, replaced 1 camera.",
    "Line 8 stopped at ST-29 for 5 minutes for a blocked chute; no parts used.",
    "Line 3, ST-10: bearing seized, 75 minutes down, used 2 bearings.",
    "ST-16 on line 2 was down 20 minutes because a valve stuck; replaced 1 valve and 2 O-rings.",
    "Line 9, ST-34: 60 minutes lost, spindle motor overheated, fitted 1 motor.",
    "Line 5 ST-07 stopped 14 minutes for a tool change; used 6 inserts.",
    "ST-23 on line 4: 33 minutes down after a belt slipped, tightened it and used 1 tensioner.",
    "Line 1, ST-12: safety light curtain tripped, 10 minutes, replaced 1 sensor.",
    "Line 6 halted at ST-20 for 50 minutes: gearbox oil leak, used 4 litres of oil and 1 seal.",
    "Line 2, ST-03: 22 minutes lost to a PLC fault, swapped 1 IO card.",
]
READING_TEXTS = [
    "Oven zone 2 temperature reads 142 C, close to the 150 C limit.",
    "Coolant pump pressure 3.2 bar, normal.",
    "Spindle vibration 4.1 mm/s, within limits.",
    "Hall humidity 55 %, fine.",
    "Motor M4 current 12 A, normal range.",
    "Compressed air line 6.4 bar, fine.",
    "Paint booth temperature 23 C, ok.",
    "Hydraulic oil temperature 71 C, too hot.",
    "Conveyor speed 0.8 m/s, normal.",
    "Weld current 135 A, within range.",
    "Chiller outlet 4 C, normal.",
    "Gearbox vibration 9.5 mm/s, above the alarm level.",
    "Dryer dew point -40 C, good.",
    "Mould temperature 95 C, ok.",
    "Battery voltage 11.2 V, low.",
    "Spray nozzle flow 2.5 l/min, normal.",
    "Dust extraction pressure -12 Pa, not enough suction.",
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


# json_mode sends no schema (LangChain's docs: "you must include instructions for formatting the output into
# the desired schema into the model call"), so its prompt carries them: the fields in words and two worked
# examples, as LangChain's few-shot structured-output guide does. (Its PydanticOutputParser instructions, a
# whole JSON schema in the prompt, made SmolLM2-135M echo the schema back: 0/20 validated.)
JSON_MODE = {
    DefectReport: ("Extract the defect report as JSON with keys defect (scratch, dent, crack, porosity or misalignment), "
                   "station, severity (1 to 5), action and optional notes. Reply with the JSON only.",
                   [("ST-05 lathe: dent on the shaft, minor. Repair it.",
                     '{"defect": "dent", "station": "ST-05", "severity": 2, "action": "repair the shaft"}'),
                    ("Station ST-40 oven: crack in the tray, dangerous. Stop the oven.",
                     '{"defect": "crack", "station": "ST-40", "severity": 5, "action": "stop the oven", '
                     '"notes": "tray cracked"}')]),
    Stoppage: ("Extract the stoppage as JSON with keys where (line 1 to 9, station), minutes, parts (name, quantity) "
               "and cause. Reply with the JSON only.",
               [("Line 6 stopped at ST-17 for 15 minutes: a fuse blew. Needed 2 fuses.",
                 '{"where": {"line": 6, "station": "ST-17"}, "minutes": 15, "parts": [{"name": "fuse", "quantity": 2}], '
                 '"cause": "a fuse blew"}'),
                ("ST-33 on line 9 was down 60 minutes, pump failure; used 1 pump and 2 gaskets.",
                 '{"where": {"line": 9, "station": "ST-33"}, "minutes": 60, "parts": [{"name": "pump", "quantity": 1}, '
                 '{"name": "gasket", "quantity": 2}], "cause": "pump failure"}')]),
    Reading: ("Extract the sensor reading as JSON with keys sensor (at most 20 characters), value (a number), unit "
              "and ok (true or false). Reply with the JSON only.",
              [("Compressor outlet pressure 9.8 bar, too high.",
                '{"sensor": "compressor pressure", "value": 9.8, "unit": "bar", "ok": false}'),
               ("Tank level 71 %, normal.", '{"sensor": "tank level", "value": 71, "unit": "%", "ok": true}')]),
}


def json_mode_prompts(limit_per_case: int | None = None):
    """(model, prompt) pairs for json_mode: the same texts, each prompt carrying its format instructions."""
    out = []
    for model, texts, _ in CASES:
        head, examples = JSON_MODE[model]
        shots = "".join(f"\n\nText: {t}\nJSON: {j}" for t, j in examples)
        out += [(model, f"{head}{shots}\n\nText: {t}\nJSON:") for t in texts[:limit_per_case]]
    return out


def grounded(obj: BaseModel, prompt: str) -> bool:
    """Whether the object's key fact comes from the text it was asked about (not from an example): the
    station for a defect or stoppage, the value for a reading. A validated object can still be a copy."""
    text = prompt.rsplit("Text: ", 1)[-1] if "\nJSON:" in prompt else prompt
    if isinstance(obj, DefectReport):
        return obj.station.lower() in text.lower()
    if isinstance(obj, Stoppage):
        return obj.where.station.lower() in text.lower() and str(obj.where.line) in text
    if isinstance(obj, Reading):
        return f"{obj.value:g}" in text
    raise TypeError(type(obj).__name__)
