"""Where a constrained answer leaves the model's own choice: greedy decoding of a tool call (tool_choice
required / named, rendered as the server renders it) or a json_mode prompt on SmolLM2, printing every step
at which the model's top token (unmasked log-softmax) is not the token the grammar let it take, with the
top 5 and which of them the grammar forbids ([X]). Shows whether a run-on string is the model's own
choice (its top token allowed at every step) or forced (its closing token forbidden).

  python benchmarks/structured_trace.py [--bundle BUNDLE] [--tools 2,3] [--json-mode 6,18]
                                        [--choice required,named] [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.structured_clients import TOOLS  # noqa: E402
from benchmarks.structured_mask import smollm2_bundle  # noqa: E402
from lineside.runtime.backend import StepBatch  # noqa: E402
from lineside.runtime.generate import Generator  # noqa: E402
from lineside.runtime.structured import Constraint, GrammarCompiler  # noqa: E402
from lineside.server import tool_calls as tc  # noqa: E402
from tests.server.structured_cases import DEFECT_TEXTS, json_mode_prompts  # noqa: E402


def trace(g: Generator, comp: GrammarCompiler, ids: list[int], constraint: Constraint, max_tokens: int) -> str:
    """Greedy under the grammar; prints the steps where the model's own top token was not taken."""
    tok = g.tokenizer

    def show(t: int) -> str:
        return repr(tok.decode([int(t)], skip_special=False))

    m = comp.matcher(constraint)
    g.backend.reset_slot(0)
    logits = g.backend.forward(StepBatch.single(0, ids, 0))[0, -1]
    out: list[int] = []
    for step in range(max_tokens):
        allowed = m.allowed()
        lp = logits - np.logaddexp.reduce(logits)
        t = int(np.argmax(np.where(allowed, lp, -np.inf)))
        top = np.argsort(-lp)[:5]
        if int(top[0]) != t:
            alts = " ".join(f"{show(x)}{'' if allowed[x] else '[X]'}:{lp[x]:.2f}" for x in top)
            print(f"  {step:3d} took {show(t)} ({lp[t]:.2f}); model's top: {alts}")
        if not m.accept(t):
            raise RuntimeError(m.error)
        if t in g.eos_ids:
            break
        out.append(t)
        if m.finished:
            break
        logits = g.backend.forward(StepBatch.single(0, [t], len(ids) + step))[0, -1]
    text = tok.decode(out)
    print(f"  -> {len(out)} tokens{' (cut at max_tokens)' if len(out) >= max_tokens else ''}: {text[:240]!r}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tools", default="", help="indices into DEFECT_TEXTS to call the tool on")
    ap.add_argument("--choice", default="required,named")
    ap.add_argument("--json-mode", default="", help="indices into json_mode_prompts()")
    ap.add_argument("--max-tokens", type=int, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        g = Generator(a.bundle or smollm2_bundle(Path(td), max_seq_len=1024), threads=a.threads)
        tok = g.tokenizer
        comp = GrammarCompiler.for_tokenizer(tok, g.backend.vocab_size, g.eos_ids)
        tools = tc.parse_tools(TOOLS)
        for i in [int(x) for x in a.tools.split(",") if x]:
            for kind in a.choice.split(","):
                choice = tc.ToolChoice(tc.ToolChoiceKind(kind), TOOLS[0]["function"]["name"] if kind == "named" else None)
                msgs, listed = tc.template_messages([{"role": "user", "content": DEFECT_TEXTS[i]}], tools,
                                                    tok.chat_template, choice)
                print(f"== tool call {kind}, text {i}: {DEFECT_TEXTS[i]!r}")
                trace(g, comp, tok.encode_chat(msgs, tools=listed), tc.tool_constraint(tools, choice), a.max_tokens)
        cases = json_mode_prompts()
        for i in [int(x) for x in a.json_mode.split(",") if x]:
            model, prompt = cases[i]
            print(f"== json_mode {model.__name__}, prompt {i}: {prompt.rsplit('Text: ', 1)[-1]!r}")
            trace(g, comp, tok.encode_chat([{"role": "user", "content": prompt}]), Constraint.json_object(),
                  a.max_tokens)


if __name__ == "__main__":
    main()
