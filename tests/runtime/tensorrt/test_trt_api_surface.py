"""The fake TensorRT the CPU tests run against is held to TensorRT's real Python API (10.3 and 11.1).

The API tables come from NVIDIA/TensorRT's pybind11 sources (scripts/trt_api_names.py); the fake module
wraps every object so that a member or keyword the real release lacks fails the test. So the builder and
backend tests in this folder also prove lineside only calls what TensorRT 10.3 / 11.1 define.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from lineside.build.tensorrt.builder import BuildOptions, build_engine
from lineside.runtime.tensorrt.key import ENGINE_FILE
from tests.runtime.tensorrt import fake_trt
from tests.runtime.tensorrt.trt_api import RELEASES, APIViolation, load_api

USED = {  # what lineside's builder and backend call, per class
    "Builder": ["create_network", "create_builder_config", "create_optimization_profile", "build_serialized_network"],
    "IBuilderConfig": ["set_memory_pool_limit", "create_timing_cache", "set_timing_cache", "get_timing_cache",
                       "progress_monitor", "add_optimization_profile", "builder_optimization_level"],
    "OnnxParser": ["parse_from_file", "num_errors", "get_error"],
    "ParserError": ["desc", "node_name", "node_operator"],
    "Runtime": ["deserialize_cuda_engine"],
    "ICudaEngine": ["num_io_tensors", "get_tensor_name", "create_execution_context"],
    "IExecutionContext": ["set_optimization_profile_async", "set_tensor_address", "set_input_shape",
                          "execute_async_v3"],
    "IOptimizationProfile": ["set_shape"],
    "ITimingCache": ["serialize"],
    "IProgressMonitor": ["phase_start", "step_complete", "phase_finish"],
    "Logger": ["WARNING"],
}


@pytest.mark.parametrize("release", RELEASES)
def test_api_tables_hold_what_lineside_calls(release):
    api = load_api(release)
    assert api["tag"].lstrip("v").startswith(release)
    for cls, members in USED.items():
        missing = set(members) - set(api["classes"][cls]["members"])
        assert not missing, (release, cls, missing)
    assert api["classes"]["IBuilderConfig"]["kwargs"]["set_timing_cache"] == ["cache", "ignore_mismatch"]
    assert api["classes"]["OnnxParser"]["init"] == ["network", "logger"]
    assert "STRONGLY_TYPED" in api["classes"]["NetworkDefinitionCreationFlag"]["members"]
    assert ("FP16" in api["classes"]["BuilderFlag"]["members"]) == (release == "10.3")  # 11: strongly typed only


def test_strict_fake_rejects_what_the_release_lacks():
    dev = fake_trt.Device()
    t10, t11 = fake_trt.make_tensorrt(dev, "10.3.0"), fake_trt.make_tensorrt(dev, "11.1.0")
    assert t10.BuilderFlag.FP16
    with pytest.raises(APIViolation, match="TensorRT v11.1 has no BuilderFlag.FP16"):
        t11.BuilderFlag.FP16  # noqa: B018
    config = t10.Builder(t10.Logger(t10.Logger.WARNING)).create_builder_config()
    with pytest.raises(APIViolation, match="no IBuilderConfig.set_fp16_mode"):
        config.set_fp16_mode(True)
    with pytest.raises(APIViolation, match="takes no keyword"):
        config.set_timing_cache(config.create_timing_cache(b""), ignore=False)
    with pytest.raises(APIViolation, match="no tensorrt.OnnxParserV2"):
        t10.OnnxParserV2  # noqa: B018
    with pytest.raises(APIViolation, match="no IBuilderConfig.profiles"):
        config.profiles = []  # the fake's own bookkeeping is not API


@pytest.mark.parametrize("version", ["10.3.0", "11.1.0"])
def test_engine_builds_through_each_release_api(trt_bundle, monkeypatch, tmp_path, version):
    dst = tmp_path / "b"
    shutil.copytree(trt_bundle("w4a16").path, dst)
    fake_trt.install(monkeypatch, trt_version=version)
    out = build_engine(dst, BuildOptions(num_slots=2, max_prefill=8, workspace_gb=1, opt_level=3))
    assert (out / ENGINE_FILE).is_file() and f"trt{version}" in out.name
    import json

    rec = json.loads((out / ENGINE_FILE).read_text())
    assert rec["fp16"] == (version == "10.3.0")  # 11 is strongly typed: the graph's fp16 MatMuls decide


@pytest.mark.parametrize("release", RELEASES)
def test_progress_monitor_overrides_only_real_methods(release):
    from lineside.build.tensorrt.progress import make_monitor

    trt = fake_trt.make_tensorrt(fake_trt.Device(), f"{release}.0")
    mon = make_monitor(trt)
    own = {n for n, v in vars(type(mon)).items() if callable(v) and not n.startswith("_")}
    assert own == set(load_api(release)["classes"]["IProgressMonitor"]["members"])


def _load_generator():
    path = Path(__file__).parents[3] / "scripts" / "trt_api_names.py"
    spec = importlib.util.spec_from_file_location("trt_api_names", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generator_reads_pybind_chains():
    src = r'''
    // py::class_<Fake>(m, "Commented");
    py::class_<ILogger, PyLogger> baseLogger{m, "ILogger", "doc; with semicolon"};
    py::enum_<ILogger::Severity>(baseLogger, "Severity", py::arithmetic())
        .value("ERROR", ILogger::Severity::kERROR)
        .value("WARNING", ILogger::Severity::kWARNING)
        .export_values();
    baseLogger.def(py::init<>()).def("log", &ILogger::log, "severity"_a, "msg"_a);
    py::class_<DefaultLogger, ILogger>(m, "Logger")
        .def(py::init<ILogger::Severity>(), "min_severity"_a = ILogger::Severity::kWARNING)
        .def_property("min_severity", [](DefaultLogger& l) { return l.s; }, [](DefaultLogger& l, int s) { l.s = s; })
        .def("set", [](DefaultLogger& self, int x) { self.x = x; return true; }, py::arg("x"), "doc");
    #if EXPORT_ALL
    m.def("get_builder_plugin_registry", &getBuilderPluginRegistry);
    #endif
    '''
    api = _load_generator().parse([src])
    assert api["module"] == ["ILogger", "Logger", "get_builder_plugin_registry"]
    logger = api["classes"]["Logger"]
    assert logger["members"] == ["ERROR", "Severity", "WARNING", "log", "min_severity", "set"]
    assert logger["init"] == ["min_severity"] and logger["kwargs"] == {"set": ["x"]}
    assert api["classes"]["ILogger"]["kwargs"] == {"log": ["severity", "msg"]}
    assert api["classes"]["ILogger.Severity"]["enum"] and "Commented" not in api["classes"]
