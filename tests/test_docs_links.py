"""The docs a newcomer follows hold together: every relative link in README.md and the tracked docs reaches a file
and, with a #fragment, a heading there (GitHub's anchor rules); every `lineside COMMAND` the README names exists."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

from tests.cli.cli_run import all_commands, lineside_app

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"\]\(([^()\s]*(?:\([^()\s]*\)[^()\s]*)*)\)")  # [text](target): one level of parentheses
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def markdown_docs() -> list[Path]:
    """README.md and every other tracked .md file (docs/, benchmarks/README.md, ...)."""
    out = subprocess.run(["git", "ls-files", "*.md"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    return [REPO / f for f in out.split() if (REPO / f).is_file()]


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading: markup and punctuation dropped, lower case, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every #fragment a link into `doc` may name: its headings' slugs (repeats numbered as GitHub does)."""
    text = FENCE.sub("", doc.read_text())
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for h in HEADING.findall(text):
        slug = github_slug(h)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(doc: Path, root: Path = REPO) -> list[str]:
    """The relative links of `doc` (outside code blocks) whose file or heading does not exist."""
    bad = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or not target:  # https:, mailto:, ...
            continue
        path, _, frag = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.relative_to(root)}: {target} (no file {path})")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{doc.relative_to(root)}: {target} (no heading #{frag} in {dest.relative_to(root)})")
    return bad


def test_github_slugs():
    assert github_slug("Quantized KV cache (`build --kv-dtype int8|int4`)") == "quantized-kv-cache-build---kv-dtype-int8int4"
    assert github_slug("Progressive prefill (`POST /v1/prefill`)") == "progressive-prefill-post-v1prefill"
    assert github_slug("Multi-LoRA: many adapters on one base") == "multi-lora-many-adapters-on-one-base"


def test_a_broken_link_is_found(tmp_path):
    """The checker itself fails on a missing file, a missing heading and a missing heading in another file."""
    (tmp_path / "other.md").write_text("# Other\n\n## Real part\n")
    doc = tmp_path / "a.md"
    doc.write_text("# Top\n\n[ok](#top) [ok](other.md#real-part) [x](#nowhere) [y](missing.md) "
                   "[z](other.md#fake)\n\n```\n[in code](#ignored)\n```\n")
    bad = broken_links(doc, root=tmp_path)
    assert [b.split(": ", 1)[1].split(" ")[0] for b in bad] == ["#nowhere", "missing.md", "other.md#fake"]


@pytest.mark.parametrize("doc", markdown_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    assert not broken_links(doc)


def readme_commands(text: str) -> set[str]:
    """`lineside CMD [SUB]` as the README's code spans and blocks write it (`a|b` alternatives each counted)."""
    text = text.replace("\\|", "|")  # a table cell escapes its bars
    code = "\n".join(m.group(0) for m in FENCE.finditer(text))
    code += "\n" + "\n".join(re.findall(r"`([^`\n]+)`", FENCE.sub("", text)))
    found = set()
    for m in re.finditer(r"(?<![\w/.-])lineside((?: [a-z][a-z0-9_|-]*){1,2})", code):
        words = m.group(1).split()
        for first in words[0].split("|"):
            subs = words[1].split("|") if len(words) > 1 else [""]
            found.update(f"{first} {s}".strip() for s in subs)
    return found


def test_every_command_the_readme_names_exists():
    commands = all_commands(lineside_app())
    groups = {c.split()[0] for c in commands if " " in c}
    unknown = []
    for cmd in sorted(readme_commands((REPO / "README.md").read_text())):
        first, _, sub = cmd.partition(" ")
        if first in groups:
            if sub and f"{first} {sub}" not in commands and not sub.startswith("-"):
                unknown.append(cmd)
        elif first not in commands:
            unknown.append(cmd)
    assert not unknown, unknown


def test_the_command_check_finds_an_unknown_command():
    named = readme_commands("Run `lineside serve B` or `lineside jetson push|frobnicate X`:\n```\nlineside nosuch\n```\n"
                            "| `lineside fleet check\\|bogus FLEET` | ... |\n")
    assert {"serve", "jetson push", "jetson frobnicate", "nosuch", "fleet check", "fleet bogus"} <= named
    commands = all_commands(lineside_app())
    assert "jetson frobnicate" not in commands and "nosuch" not in commands


def readme_options(text: str) -> set[tuple[str, str]]:
    """(command, --option) for every option the README writes after `lineside COMMAND` on one command line
    (a fenced usage block's continuation lines joined; another command, `&&`, `;` or a comment ends it)."""
    text = text.replace("\\|", "|")
    spans = [m.group(0) for m in FENCE.finditer(text)] + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    out = set()
    for span in spans:
        span = re.sub(r"\n\s+\[", " [", re.sub(r"\\\n\s*", " ", span))
        for line in span.splitlines():
            for m in re.finditer(r"(?<![\w/.-])lineside ([a-z][a-z-]*(?: [a-z][a-z-]*)?)(.*)", line):
                rest = re.split(r"&&|;|#|(?<![\w/.-])lineside ", m.group(2))[0]
                out.update((m.group(1), o) for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest))
    return out


def unknown_options(text: str) -> list[str]:
    """The README's `lineside CMD ... --opt` whose CMD has no such option."""
    commands = all_commands(lineside_app())
    bad = []
    for words, opt in sorted(readme_options(text)):
        cmd = words if words in commands else words.split()[0]
        if cmd not in commands:
            continue  # an unknown command is test_every_command_the_readme_names_exists's to report
        params = commands[cmd].params
        if opt != "--help" and not any(opt in (*p.opts, *getattr(p, "secondary_opts", ())) for p in params):
            bad.append(f"lineside {cmd} {opt}")
    return bad


def test_every_option_the_readme_gives_a_command_exists():
    assert not unknown_options((REPO / "README.md").read_text())


def test_the_option_check_finds_an_option_of_another_command():
    text = ("`lineside serve B --port 1 --max-seq-len 9` and\n```\nlineside build C -o B \\\n    --quant w4a16 --frobnicate\n"
            "lineside jetson plan M --device orin-nano-8 && lineside serve B --threads 2\n```\n")
    assert unknown_options(text) == ["lineside build --frobnicate", "lineside serve --max-seq-len"]
