"""TensorRT's log into Python logging, keeping its errors: a failed call (deserialize_cuda_engine answering None)
can then say why in its one line (a plan of another TensorRT or GPU, a corrupt file) instead of 'see above'."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("lineside.tensorrt")


def capturing_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that logs warnings and errors and keeps the errors' first lines in ``.errors``."""

    class CapturingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            line = (str(msg).splitlines() or [""])[0]
            if severity in (trt.ILogger.ERROR, trt.ILogger.INTERNAL_ERROR):
                self.errors.append(line)
                log.error("TensorRT: %s", line)
            elif severity == trt.ILogger.WARNING:
                log.warning("TensorRT: %s", line)

    return CapturingLogger()
