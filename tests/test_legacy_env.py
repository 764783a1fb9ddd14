"""Upgrading from trtedge (before 0.2.0): the environment variables it read keep their meaning under the new
name, with a warning to rename them, instead of being dropped without a word (TRTEDGE_API_KEY left the server
open)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from lineside.legacy_env import adopt_old_names


def test_old_names_are_read_as_the_new_ones_and_named_in_a_warning():
    env = {"TRTEDGE_API_KEY": "s3cret", "TRTEDGE_SSH": "ssh -p 2222", "TRTEDGE_LOG": "x", "PATH": "/bin"}
    notes = adopt_old_names(env)
    assert env["LINESIDE_API_KEY"] == "s3cret" and env["LINESIDE_SSH"] == "ssh -p 2222"
    assert "LINESIDE_LOG" not in env  # not a name trtedge read: left alone
    assert len(notes) == 2 and all("\n" not in n and n.startswith("warning: TRTEDGE_") for n in notes)
    assert "rename it LINESIDE_API_KEY" in notes[0] and "s3cret" not in " ".join(notes)


def test_the_new_name_wins_and_the_old_one_is_said_to_be_ignored():
    env = {"TRTEDGE_API_KEY": "old", "LINESIDE_API_KEY": "new", "TRTEDGE_SSH": "ssh", "LINESIDE_SSH": "ssh"}
    notes = adopt_old_names(env)
    assert env["LINESIDE_API_KEY"] == "new"
    assert notes == ["warning: TRTEDGE_API_KEY is ignored: LINESIDE_API_KEY is set (trtedge was renamed lineside "
                     "in 0.2.0); remove TRTEDGE_API_KEY"]  # equal values: nothing to say
    assert adopt_old_names({"PATH": "/bin"}) == []


def test_serve_with_the_trtedge_api_key_still_requires_it(tiny_bundle):
    """A container or unit file made for trtedge passes TRTEDGE_API_KEY: after the upgrade `lineside serve`
    answered every client without a key."""
    from lineside.bench.inprocess import free_port, wait_ready

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LINESIDE_", "TRTEDGE_"))}
    env.update(TRTEDGE_API_KEY="old-s3cret", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(tiny_bundle), "--port", str(port),
                             "--threads", "1", "--tokenizer-processes", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 60, alive=lambda: proc.poll() is None)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer old-s3cret"}, timeout=10)
        assert r.status_code == 200
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "TRTEDGE_API_KEY is trtedge's name from before 0.2.0" in out and "old-s3cret" not in out
