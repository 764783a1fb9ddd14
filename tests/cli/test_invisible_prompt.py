"""The CLI strips pasted invisible characters as the server does, so one prompt gives one answer either way."""

from __future__ import annotations

import os
import subprocess
import sys

from lineside.runtime.invisible import strip_invisible
from lineside.server.request_mapping import clean_text
from tests.cli.cli_run import REPO, run_cli

# a BOM, zero-width spaces, a soft hyphen and a stray joiner next to ASCII: all pasted artefacts
PASTED = "\ufeffthe\u200b quick\u00ad brown\u200d fox\u2060"
CLEAN = "the quick brown fox"


def test_strip_is_the_servers_cleaning():
    assert strip_invisible(PASTED) == clean_text(PASTED, "prompt") == CLEAN
    assert strip_invisible("👩\u200d💻") == "👩\u200d💻"  # a joiner inside an emoji sequence means something


def _generate(bundle, prompt: str) -> str:
    p = run_cli("generate", bundle, "--prompt", prompt, "--max-tokens", "12", "--temperature", "0",
                "--backend", "onnxruntime")
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_generate_answers_a_pasted_prompt_as_the_clean_one(tiny_bundle):
    """`generate` fed the invisible characters to the tokenizer (other ids, another answer than the server's)."""
    assert _generate(tiny_bundle, PASTED) == _generate(tiny_bundle, CLEAN)


def test_chat_answers_a_pasted_line_as_the_clean_one(tiny_bundle):
    def chat(line: str) -> str:
        p = subprocess.run([sys.executable, "-m", "lineside", "chat", str(tiny_bundle), "--backend", "onnxruntime",
                            "--max-tokens", "12", "--system", "\u200bbe brief"], input=f"{line}\n\n",
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert chat(PASTED) == chat(CLEAN)
