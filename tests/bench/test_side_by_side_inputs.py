"""The README's side-by-side scripts on bad input and on a server that fails or is interrupted while starting:
one line and a non-zero exit, never a traceback, and no server left running."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import cpu_side_by_side, served_side_by_side  # noqa: E402


def _main(module, argv, monkeypatch) -> SystemExit:
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    with pytest.raises(SystemExit) as exc:
        module.main()
    return exc.value


@pytest.mark.parametrize("module", [served_side_by_side, cpu_side_by_side])
def test_not_a_bundle_is_one_line_before_any_work(module, tmp_path, monkeypatch):
    monkeypatch.setattr(served_side_by_side, "STARTED", [])
    extra = ["--only", "lineside", "--work", str(tmp_path / "w")] if module is cpu_side_by_side else []
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    err = _main(module, ["--bundle", str(tmp_path), "--gguf", str(gguf), *extra], monkeypatch)
    assert isinstance(err.code, str) and "\n" not in err.code and "manifest.json" in err.code
    assert served_side_by_side.STARTED == []


@pytest.mark.parametrize(("module", "option"), [(served_side_by_side, "--rounds"), (served_side_by_side, "--threads"),
                                                (served_side_by_side, "--max-tokens"), (cpu_side_by_side, "--repeats"),
                                                (cpu_side_by_side, "--threads")])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_counts_are_checked_when_parsed(module, option, value, tmp_path, monkeypatch, capsys):
    assert _main(module, ["--bundle", str(tmp_path), option, value], monkeypatch).code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def test_unknown_runtime_in_only_is_refused(monkeypatch, capsys):
    assert _main(cpu_side_by_side, ["--only", "lineside,llamacpp"], monkeypatch).code == 2
    assert "--only" in capsys.readouterr().err


def test_unwritable_json_is_refused_before_any_server_starts(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(served_side_by_side, "STARTED", [])
    err = _main(served_side_by_side, ["--bundle", str(tiny_bundle), "--gguf", str(tiny_bundle / "manifest.json"),
                                      "--json", str(tmp_path / "no" / "x.json")], monkeypatch)
    assert "--json" in err.code and "does not exist" in err.code and served_side_by_side.STARTED == []


def test_a_server_that_fails_to_start_is_reported_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(served_side_by_side, "STARTED", [])
    cmd = [sys.executable, "-c", "import sys; print('error: bundle file x fails its sha256 check'); sys.exit(1)"]
    with pytest.raises(SystemExit) as exc:
        served_side_by_side.spawn("lineside", cmd, 9, "m", 1, tmp_path)
    assert "did not start" in exc.value.code and "fails its sha256 check" in exc.value.code
    assert "\n" not in exc.value.code


def test_ctrl_c_while_a_server_starts_stops_it(tmp_path, monkeypatch):
    monkeypatch.setattr(served_side_by_side, "STARTED", [])

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(served_side_by_side, "wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        served_side_by_side.spawn("lineside", [sys.executable, "-c", "import threading; threading.Event().wait()"], 9, "m", 1,
                                  tmp_path)
    (proc,) = served_side_by_side.STARTED
    assert proc.poll() is not None
