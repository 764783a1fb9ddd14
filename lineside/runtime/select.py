"""`--backend auto|onnxruntime|tensorrt`: pick the backend for a bundle on this machine and say why."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from lineside.bundle import Bundle
from lineside.errors import BackendUnavailable, LinesideError
from lineside.runtime.backend import Backend
from lineside.runtime.lora_stack import LoraSlotsConfig

CHOICES = ("auto", "onnxruntime", "tensorrt")


@dataclass
class Decision:
    backend: str  # "onnxruntime" | "tensorrt"
    reason: str  # one line: which and why

    @property
    def message(self) -> str:
        return f"backend: {self.backend} ({self.reason})"


def decide_backend(bundle: Bundle, requested: str = "auto", lora: LoraSlotsConfig | None = None) -> Decision:
    """Decide without loading anything heavy; raises a one-line error when ``tensorrt`` was asked and can't run;
    ``lora``: TensorRT also needs the LoRA graph's engine for these slots."""
    from lineside.runtime.tensorrt.key import find_engine, graph_files_sha, machine_key

    if requested not in CHOICES:
        raise LinesideError(f"--backend {requested!r} is not one of {', '.join(CHOICES)}")
    if requested == "onnxruntime":
        return Decision("onnxruntime", "asked for with --backend onnxruntime")
    if "trt" not in bundle.flavors:
        if requested == "tensorrt":
            bundle.flavor("trt")  # raises: names the flavors the bundle has and the rebuild option
        return Decision("onnxruntime", "the bundle has no trt graph")
    try:
        here = machine_key()
        d, _meta = find_engine(bundle.path, here, bundle.manifest.graph_sha("trt"),
                               content=graph_files_sha(bundle.manifest))
    except LinesideError as e:
        if requested == "tensorrt":
            raise
        return Decision("onnxruntime", f"TensorRT not used: {e}")
    if lora is not None:  # adapters need the LoRA graph's engine for these slots
        try:
            find_engine(bundle.path, here, None, lora=(lora.max_loras, lora.max_rank),
                        content=graph_files_sha(bundle.manifest))
        except LinesideError as e:
            if requested == "tensorrt":
                raise
            return Decision("onnxruntime", f"TensorRT not used for adapters: {e}")
    return Decision("tensorrt", f"engine {d.name} matches this GPU ({here.gpu_name}, SM {here.compute_capability})")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def choose_backend(bundle: Bundle, requested: str = "auto", num_slots: int = 4,
                   say: Callable[[str], None] = _say, threads: int | None = None,
                   lora: LoraSlotsConfig | None = None, decided: Callable[[Decision], None] | None = None) -> Backend:
    """Create the chosen backend; ``say`` gets the one-line decision (stderr by default); ``threads`` are
    onnxruntime's intra-op threads when it is the one chosen; ``lora``: run the LoRA graph with these slots;
    ``decided`` gets the final Decision (the engine keeps its reason for /health/ready and `bench`)."""
    dec = decide_backend(bundle, requested, lora)
    if dec.backend == "tensorrt":
        from lineside.runtime.tensorrt.backend import TensorRTBackend

        try:
            backend = TensorRTBackend(bundle, num_slots=num_slots, lora=lora)
        except BackendUnavailable as e:
            if requested == "tensorrt":
                raise
            dec = Decision("onnxruntime", f"TensorRT engine failed to load: {e}")
        else:
            say(dec.message)
            if decided is not None:
                decided(dec)
            return backend
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    say(dec.message)
    if decided is not None:
        decided(dec)
    return OnnxRuntimeBackend(bundle, num_slots=num_slots, threads=threads, lora=lora)
