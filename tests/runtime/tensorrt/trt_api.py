"""Hold the fake TensorRT to the real Python API of a TensorRT release.

``tests/runtime/tensorrt/data/tensorrt_api_<ver>.json`` lists, per class of TensorRT's Python bindings, the members
and keyword names (made by scripts/trt_api_names.py from NVIDIA/TensorRT's pybind11 sources at the release
tag). ``strict_module`` wraps the fake module so that lineside may only touch names that exist there: an
attribute or keyword TensorRT doesn't have fails the test instead of passing against the fake.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
RELEASES = ("10.3", "11.1")  # JetPack 6's TensorRT, and the newest release

# what each factory method returns in the real API
RETURNS = {
    ("Builder", "create_network"): "INetworkDefinition",
    ("Builder", "create_builder_config"): "IBuilderConfig",
    ("Builder", "create_optimization_profile"): "IOptimizationProfile",
    ("IBuilderConfig", "create_timing_cache"): "ITimingCache",
    ("IBuilderConfig", "get_timing_cache"): "ITimingCache",
    ("OnnxParser", "get_error"): "ParserError",
    ("Runtime", "deserialize_cuda_engine"): "ICudaEngine",
    ("ICudaEngine", "create_execution_context"): "IExecutionContext",
}


@lru_cache
def load_api(release: str) -> dict[str, Any]:
    return json.loads((DATA / f"tensorrt_api_{release}.json").read_text())


def release_for(version: str) -> str:
    """The API table a fake ``tensorrt.__version__`` is held to: 10.x → 10.3, 11+ → 11.1."""
    return "10.3" if int(version.split(".")[0]) < 11 else "11.1"


class APIViolation(AssertionError):
    pass


def unwrap(x: Any) -> Any:
    return object.__getattribute__(x, "_inner") if isinstance(x, Strict) else x


class Strict:
    """A fake TensorRT object seen through the real class's member list."""

    def __init__(self, inner: Any, cls: str, api: dict[str, Any]):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_api", api)

    def _check(self, name: str) -> dict[str, Any]:
        cls, api = object.__getattribute__(self, "_cls"), object.__getattribute__(self, "_api")
        spec = api["classes"].get(cls)
        if spec is None or name not in spec["members"]:
            raise APIViolation(f"TensorRT {api['tag']} has no {cls}.{name}")
        return spec

    def __getattr__(self, name: str) -> Any:
        spec = self._check(name)
        cls, api = object.__getattribute__(self, "_cls"), object.__getattribute__(self, "_api")
        value = getattr(object.__getattribute__(self, "_inner"), name)
        if not callable(value) or isinstance(value, (int, str)):
            return value
        known = spec["kwargs"].get(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            bad = [k for k in kwargs if known is None or k not in known]
            if bad:
                raise APIViolation(f"TensorRT {api['tag']}: {cls}.{name} takes no keyword {bad} (has {known})")
            out = value(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
            ret = RETURNS.get((cls, name))
            return Strict(out, ret, api) if ret and out is not None else out

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        self._check(name)
        setattr(object.__getattribute__(self, "_inner"), name, value)

    def __int__(self) -> int:
        return int(object.__getattribute__(self, "_inner"))


class StrictClass:
    """A fake TensorRT class: constructing it returns a Strict instance; class attributes are checked."""

    def __init__(self, fake: type, cls: str, api: dict[str, Any]):
        self.fake, self.cls, self.api = fake, cls, api

    def __call__(self, *args: Any, **kwargs: Any) -> Strict:
        init = self.api["classes"][self.cls]["init"]
        bad = [k for k in kwargs if k not in init]
        if bad:
            raise APIViolation(f"TensorRT {self.api['tag']}: {self.cls}() takes no keyword {bad} (has {init})")
        return Strict(self.fake(*[unwrap(a) for a in args], **kwargs), self.cls, self.api)

    def __getattr__(self, name: str) -> Any:
        if name not in self.api["classes"][self.cls]["members"]:
            raise APIViolation(f"TensorRT {self.api['tag']} has no {self.cls}.{name}")
        return getattr(self.fake, name)


class StrictModule:
    """``import tensorrt`` seen through the release's module-level names."""

    def __init__(self, fake: Any, api: dict[str, Any], passthrough: tuple[str, ...] = ()):
        self._fake, self._api, self._passthrough = fake, api, passthrough

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._passthrough:
            return getattr(self._fake, name)
        if name not in self._api["module"]:
            raise APIViolation(f"TensorRT {self._api['tag']} has no tensorrt.{name}")
        value = getattr(self._fake, name)
        if name in self._passthrough:
            return value
        if isinstance(value, type):
            return StrictClass(value, name, self._api)
        return Strict(value, name, self._api)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._fake, name, value)
