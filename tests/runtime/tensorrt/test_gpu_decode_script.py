"""scripts/gpu_check.sh's decode benchmark (benchmarks/gpu_decode.py) runs end to end against the fake
TensorRT, so the script a GPU machine will run can't rot unseen; on CPU its numbers mean nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.runtime.tensorrt import fake_trt

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_decode.py"


def test_gpu_decode_benchmark_runs_through_the_backend(monkeypatch, tmp_path, dense_checkpoint):
    # made before the fakes go in (transformers probes for tensorrt); llama-gqa made for the bundle's 1024 tokens
    src = dense_checkpoint("llama-gqa-ctx1024", "llama", num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False, max_position_embeddings=1024)
    dev = fake_trt.install(monkeypatch)
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = mod.run(tmp_path, 0, tiny=True, src=src).strip().splitlines()
    assert lines[0].startswith("| GPU Fake GPU SM 8.7 | TensorRT 10.3.0") and "tiny llama w4a16" in lines[1]
    rows = {int(line.split("|")[1]): line.split("|")[2:-1] for line in lines[4:]}
    assert sorted(rows) == [1, 4]
    for slots, cells in rows.items():
        ttft, tps = float(cells[0]), float(cells[1])
        replays, captures, eager = (int(x) for x in cells[3].split("/"))
        assert ttft > 0 and tps > 0
        assert eager == slots  # the prompts ran eagerly, every decode step from a CUDA Graph
        assert replays + captures >= mod.STEPS
    assert dev.launched_graphs >= 2 * mod.STEPS - 4


def test_gpu_decode_without_tensorrt_refuses_in_one_line_before_building(monkeypatch, tmp_path):
    """On a machine without TensorRT (or a GPU) the script built the whole bundle, then died in a traceback from
    the engine build; it says why in one line first."""
    import sys

    import pytest

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["gpu_decode.py", str(tmp_path / "w"), "--tiny"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    said = str(e.value.code)
    assert said.startswith("gpu_decode: TensorRT is not installed") and "\n" not in said, said
    assert not (tmp_path / "w" / "b").exists() and not (tmp_path / "w" / "ck").exists()


def test_gpu_decode_runs_the_checkout_it_lives_in(tmp_path):
    """scripts/gpu_check.sh runs ``python benchmarks/gpu_decode.py``: Python puts benchmarks/ (not the repo root)
    first on sys.path, so without the repo root the script failed with ModuleNotFoundError on a checkout whose
    lineside is not pip-installed (a copied tree, an editable install pointing elsewhere) — or benchmarked another
    installed lineside than the one the GPU tests just ran. A stand-in that refuses to be imported shadows any
    installed one here."""
    import os
    import subprocess
    import sys

    shadow = tmp_path / "shadow" / "lineside"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not the checkout lineside')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-500:]
    assert "scratch directory" in res.stdout
