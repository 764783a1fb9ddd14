"""onnxruntime session settings the backend chooses: intra-op spinning is on unless LINESIDE_ORT_SPIN=0 or spin=False."""

from __future__ import annotations

import pytest

from lineside.bundle import open_bundle
from lineside.runtime.onnxruntime_backend import SPIN_ENV, OnnxRuntimeBackend


def _spin(be: OnnxRuntimeBackend) -> str:
    return be.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("env,arg,want", [(None, None, "1"), ("0", None, "0"), ("0", True, "1"), (None, False, "0")])
def test_spinning(tiny_bundle, monkeypatch, env, arg, want):
    if env is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_ENV, env)
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), spin=arg)
    assert _spin(be) == want and be.spinning == (want == "1")
