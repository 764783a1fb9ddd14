"""User-facing errors: one clear line (what is wrong, what to do), never a traceback."""

from __future__ import annotations


class LinesideError(Exception):
    """An error caused by the user's input or environment; the CLI prints its message and exits 1."""

    exit_code = 1


class CheckpointError(LinesideError):
    """The checkpoint (HF directory or GGUF) is missing, malformed, truncated or unsupported."""


class BundleError(LinesideError):
    """The bundle is missing files, fails a checksum, or was built for something else."""


class ConfigError(LinesideError):
    """A model config is inconsistent or names an unsupported architecture."""


class BackendUnavailable(LinesideError):
    """The requested backend (TensorRT, a GPU, a driver) is not available on this machine."""


class ArgumentsError(LinesideError):
    """A combination of arguments the parser alone cannot refuse (a prompt given twice, or not at all): exit 2, as
    the parser's own usage errors, so a script tells a wrong call from a failed run."""

    exit_code = 2
