"""--chat-template on `serve`, `generate` and `chat`: a template that cannot be read, is not Jinja, or fails on a
one-message conversation is one line and exit 1 before anything loads (the bundle path here does not even exist:
the template is checked first); a good one is used."""

from __future__ import annotations

import pytest

from tests.cli.cli_run import assert_one_line_error, run_cli


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi", "--chat"], ["chat"]])
@pytest.mark.parametrize("template, words", [
    ("missing", "looks like a file path but cannot be read"),
    ("syntax", "not a valid jinja template (line 2"),
    ("renders", "fails to render a one-message conversation"),
    ("{% for m in messages %}{{ m.content }", "not a valid jinja template"),
    ("builtin:nope", "no such shipped template"),
])
def test_bad_chat_template_is_one_line_before_loading(tmp_path, command, template, words):
    (tmp_path / "syntax.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    (tmp_path / "renders.jinja").write_text("{{ messages[1].content }}")
    files = {"missing": tmp_path / "no" / "t.jinja", "syntax": tmp_path / "syntax.jinja",
             "renders": tmp_path / "renders.jinja"}
    value = str(files.get(template, template))
    proc = run_cli(command[0], tmp_path / "no-such-bundle", *command[1:], "--chat-template", value)
    line = assert_one_line_error(proc, "--chat-template", words, code=1)
    assert "no-such-bundle" not in line


def test_generate_with_a_template_file(tiny_bundle, tmp_path):
    t = tmp_path / "plain.jinja"
    t.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    proc = run_cli("generate", tiny_bundle, "--prompt", "hello", "--chat", "--chat-template", t, "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr


def test_generate_template_without_chat_is_one_line(tmp_path):
    """Without --chat the template would render nothing: said, not silently ignored."""
    proc = run_cli("generate", tmp_path / "no-such-bundle", "--prompt", "hi", "--chat-template", "builtin:smollm2_tools")
    assert_one_line_error(proc, "--chat-template needs --chat", code=1)


def test_serve_rejects_an_unknown_tool_call_parser(tmp_path):
    proc = run_cli("serve", tmp_path / "no-such-bundle", "--tool-call-parser", "pythonic")
    assert_one_line_error(proc, "--tool-call-parser", "hermes", "deepseek_v3", "deepseek_v31", code=1)
