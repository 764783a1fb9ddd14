"""The policy file: seed defaults, strict parsing, one-line errors before the server starts."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lineside.errors import LinesideError
from lineside.runtime.request import Mode
from lineside.server.slo.policy import SloPolicy, load_policy, parse_policy


def test_defaults_are_the_seed_numbers():
    p = SloPolicy()
    assert (p.level_1.ttft_p90_s, p.level_1.memory_ratio, p.level_2.ttft_p90_s) == (0.8, 0.85, 1.5)
    assert p.recover_after_s == 300 and p.backoff_factor == 2 and p.fallback_modes == (Mode.BATCH,)


def test_yaml_and_json_files_load(tmp_path):
    (tmp_path / "p.yaml").write_text("level_1: {ttft_p90_s: 0.5}\nlevel_2: {ttft_p90_s: 1.0}\nrecover_after_s: 60\n"
                                     "pins:\n  - {start: '22:00', end: '06:00', level: 1}\n")
    p = load_policy(tmp_path / "p.yaml")
    assert (p.level_1.ttft_p90_s, p.level_2.ttft_p90_s, p.recover_after_s, len(p.pins)) == (0.5, 1.0, 60, 1)
    (tmp_path / "p.json").write_text('{"cache": {"max_entries": 8, "ttl_s": 5}}')
    assert load_policy(tmp_path / "p.json").cache.max_entries == 8
    (tmp_path / "twice.json").write_text('{"cache": {"ttl_s": 5, "ttl_s": 9}}')
    with pytest.raises(LinesideError, match="key 'ttl_s' is written twice"):
        load_policy(tmp_path / "twice.json")


@pytest.mark.parametrize(("text", "needle"), [
    ("level_1: {ttft_p90_s: 2.0}\n", "level_2.ttft_p90_s (1.5) must be above level_1.ttft_p90_s (2.0) (level_2 is "
     "not in the file: its default block counts; give level_2 too)"),  # the file has no level_2 to look at
    ("level_2: {ttft_p90_s: 0.5}\n", "(level_1 is not in the file: its default block counts; give level_1 too)"),
    ("recover_afetr_s: 10\n", "recover_afetr_s: unknown key; known keys here: level_1"),
    ("level_2: {ttft: 1}\n", "level_2.ttft: unknown key; known keys here: ttft_p90_s"),
    ("pins: [{start: '25:00', end: '06:00', level: 1}]\n", "pins[0].start"),
    ("level_1: [\n", "not valid YAML"),
    ("- 1\n", "the top level must be a mapping"),
    (b"\xff\xfelevel_1: {}\n", "not UTF-8"),  # a UTF-16 editor's save
    # YAML 1.1 reads an unquoted 22:00 as the base-60 number 1320 (pydantic took it as 00:22 UTC, and the
    # controller's naive local time could not be compared with it)
    ("pins: [{start: 22:00, end: '06:00', level: 1}]\n", 'pins[0].start: YAML read 22:00 unquoted as the number'),
    ("pins: [{start: '22:00', end: 6:30, level: 1}]\n", 'quote it: "HH:MM"'),
    ("pins: [{start: '22:00+02:00', end: '06:00', level: 1}]\n", "pins[0].start: a local time has no zone"),
    # YAML 1.1 reads yes/on/true as a boolean, which pydantic took as the number 1
    ("level_1: {ttft_p90_s: yes}\n", "level_1.ttft_p90_s: true is not a number"),
    ("min_samples: on\n", "min_samples: true is not a number"),
    ("pins: [{start: '22:00', end: '06:00', level: true}]\n", "pins[0].level: true is not a number"),
    ("window_s: .inf\n", "window_s: Input should be a finite number"),  # kept every sample forever
    ("level_2: {ttft_p90_s: .inf}\n", "level_2.ttft_p90_s: Input should be a finite number"),
    ("pins: [{start: '08:00', end: '08:00', level: 1}]\n", "pins[0]: start and end are the same time"),
    ("level_1: {}\nlevel_2: {}\n", "no level has a threshold"),  # a guard that could never degrade
    # YAML keeps the last of two equal keys: the first level_1 was dropped without a word
    ("level_1: {ttft_p90_s: 0.5}\nwindow_s: 30\nlevel_1: {memory_ratio: 0.9}\n",
     "key 'level_1' (lines 1 and 3) is written twice"),
    ("pins: [{start: '22:00', end: '06:00', level: 1, level: 2}]\n", "key 'level' (lines 1 and 1) is written twice"),
    ("[]\n", "the top level must be a mapping"),  # an empty list was read as no settings: the defaults
    # a tab indent: the line and the fix, not PyYAML's "while scanning for the next token"
    ("level_1:\n\tttft_p90_s: 0.5\n", "not valid YAML at line 2 (found character '\\t' that cannot start any token); "
     "indent with spaces, not tabs"),
    # one pin written as a mapping, a mode as a word: say "a list", not pydantic's "a valid tuple"
    ("pins:\n  start: '22:00'\n", "pins: give a list (- item lines, or [a, b]); got {'start': '22:00'}"),
    ("fallback_modes: batch\n", "fallback_modes: give a list"),
    ("level_1: [0.5]\n", "level_1: give a mapping of keys"),
])
def test_bad_policies_are_one_line(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(LinesideError) as e:
        load_policy(path)
    assert needle in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_out_of_order_blocks_both_in_the_file_get_no_default_hint():
    with pytest.raises(LinesideError) as e:
        parse_policy({"level_1": {"ttft_p90_s": 2.0}, "level_2": {"ttft_p90_s": 1.0}})
    assert str(e.value).endswith("level_2.ttft_p90_s (1.0) must be above level_1.ttft_p90_s (2.0)")


def test_a_json_policy_saved_with_a_bom_loads_and_bad_json_names_its_line(tmp_path):
    # Notepad writes UTF-8 with a BOM; the YAML reader took it and json.loads refused the same file
    (tmp_path / "p.json").write_bytes(b"\xef\xbb\xbf" + b'{"level_1": {"ttft_p90_s": 0.5}}')
    assert load_policy(tmp_path / "p.json").level_1.ttft_p90_s == 0.5
    (tmp_path / "y.JSON").write_text("level_1:\n  ttft_p90_s: 0.5\n")  # YAML in a .json file (any case)
    with pytest.raises(LinesideError, match=r"not valid JSON at line 1 \(Expecting value\); .*name the file \.yaml"):
        load_policy(tmp_path / "y.JSON")


def test_a_pin_compares_with_the_controllers_local_time():
    p = load_policy_text("pins: [{start: '22:00', end: '06:00', level: 1}]\n")
    assert (p.pinned_level(dt.time(23, 0)), p.pinned_level(dt.time(0, 30)), p.pinned_level(dt.time(12, 0))) == (1, 1, 0)


def load_policy_text(text: str) -> SloPolicy:
    import yaml

    return parse_policy(yaml.safe_load(text))


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    return subprocess.run([sys.executable, "-m", "lineside", "serve", *args, "--port", "1"], capture_output=True,
                          text=True, timeout=120, env=env)


def test_serve_refuses_a_bad_policy_and_another_tokenizer_in_one_line(tiny_bundle, tmp_path):
    import shutil

    from lineside.bundle import read_manifest, write_manifest

    bad = tmp_path / "bad.yaml"
    bad.write_text("level_1: {ttft_p90_s: 3}\n")
    run = _serve(str(tiny_bundle), "--slo-policy", str(bad))
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "level_2.ttft_p90_s (1.5) must be above" in run.stderr.strip().splitlines()[-1]

    other = tmp_path / "other-tok"
    shutil.copytree(tiny_bundle, other)
    tok = other / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"unk_token"', '"unk_token" ', 1) + " ")
    write_manifest(other, read_manifest(other))
    run = _serve(str(tiny_bundle), "--fallback", str(other))
    assert run.returncode != 0 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "its tokenizer differs" in last and "--fallback" in last


def test_serve_refuses_a_fallback_that_cannot_run_the_speculation_in_one_line(tiny_bundles, tiny_bundle):
    """The fallback engine runs the server's --speculative too: a fallback without the layerskip draft graph is
    refused before the server binds (it used to fail after "serving on", when the fallback loaded)."""
    primary = tiny_bundles(draft_layers=(1,))
    run = _serve(str(primary), "--speculative", "layerskip:1", "--fallback", str(tiny_bundle))
    assert run.returncode != 0 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "--fallback" in last and "draft graph" in last and "serving on" not in run.stderr
