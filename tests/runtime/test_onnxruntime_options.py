"""onnxruntime session settings the backend chooses: intra-op spinning is off unless asked for."""

from __future__ import annotations

import pytest

from lineside.bundle import open_bundle
from lineside.runtime.onnxruntime_backend import SPIN_ENV, OnnxRuntimeBackend


def _spin(be: OnnxRuntimeBackend) -> str:
    return be.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("env,arg,want", [(None, None, "0"), ("1", None, "1"), ("1", False, "0"), (None, True, "1")])
def test_spinning(tiny_bundle, monkeypatch, env, arg, want):
    if env is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_ENV, env)
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), spin=arg)
    assert _spin(be) == want and be.spinning == (want == "1")
