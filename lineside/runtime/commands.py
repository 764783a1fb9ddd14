"""`lineside logits` and `lineside generate`: the direct single-stream paths."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from lineside import cli_checks as checks
from lineside.errors import LinesideError
from lineside.runtime.invisible import strip_invisible

BACKENDS = ("auto", "onnxruntime", "tensorrt")
YOU = "you> "  # chat's prompt for a line, shown only when stdin is a terminal
NO_TEMPLATE_NOTE = ("note: this bundle has no chat template; --chat falls back to a plain \"role: text\" transcript")


SYSTEM_OPTION = {False: "--system", True: "--system-file"}  # which one gave the system prompt: its errors name it
SEED_HELP = ("random seed: the same seed, the same output; any 64-bit integer, as the server's seed; -1 (or none) "
             "picks a random one each run, as llama.cpp's --seed -1 and the server's seed -1")


def _parse_ids(text: str) -> list[int]:
    """Token ids separated by commas or spaces ("1,2,3", "1, 2, 3", "1 2 3"); an empty one between commas is an
    error, not skipped."""
    if not text.strip():
        return []
    items = re.split(r"\s*,\s*|\s+", text.strip())
    if "" in items:
        raise LinesideError(f"--ids {text!r}: an empty id between commas; give token ids like 1,2,3")
    try:
        return [int(x) for x in items]
    except ValueError:
        raise LinesideError(f"--ids {text!r}: give comma-separated integers, e.g. 1,2,3") from None


def logits(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    ids: Annotated[str, typer.Option(help="comma-separated token ids")],
    output: Annotated[Path, typer.Option("-o", "--output", help=".npy file for float32 logits [T, vocab] "
                                                                "(written under exactly this name)")],
    *,
    mode: Annotated[str, typer.Option(help="prefill (one step) | decode (one token per step via the cache)")] = "prefill",
    flavor: Annotated[str | None, typer.Option(help="graph flavor to run: cpu | trt (default: cpu when the "
                                                    "bundle has it, else trt)")] = None,
    threads: Annotated[int | None, checks.number_option(low=1, high=checks.MAX_THREADS,
                                                        help="onnxruntime intra-op threads (default: one per physical core)")] = None,
    lora: Annotated[str | None, typer.Option(help="apply this adapter of the bundle (`lineside lora list`)")] = None,
) -> None:
    """Write float32 logits for every position (parity checks against a reference)."""
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    mode = checks.choice(mode, "--mode", ("prefill", "decode"))
    if flavor is not None:
        flavor = checks.choice(flavor, "--flavor", ("cpu", "trt"))
    output = checks.output_file(output, "-o")
    token_ids = _parse_ids(ids)
    if not token_ids:
        raise LinesideError("--ids is empty; give comma-separated token ids, e.g. 1,2,3")
    b = open_bundle(bundle)
    flavor = flavor or ("cpu" if "cpu" in b.flavors else "trt")
    adapter, slots = None, None
    if lora is not None:
        from lineside.runtime.adapters import bundle_adapter
        from lineside.runtime.lora_stack import LoraSlotsConfig

        adapter = bundle_adapter(b, lora)
        slots = LoraSlotsConfig(max_loras=1, max_rank=adapter.rank)
    be = OnnxRuntimeBackend(b, num_slots=1, flavor=flavor, threads=threads,
                            accuracy_level=0 if flavor == "trt" else None, lora=slots)
    if adapter is not None:
        be.load_adapter(1, adapter)
    out = compute_logits(be, token_ids, mode, adapter=1 if adapter is not None else 0)
    with checks.staged_file(output) as tmp, open(tmp, "wb") as f:
        np.save(f, out.astype(np.float32))  # a file object: np.save adds no ".npy" to the name
    print(f"{output}: logits {list(out.shape)} ({mode}, {flavor}{f', adapter {lora}' if lora else ''})")


def generate(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    prompt_arg: Annotated[str | None, typer.Argument(
        metavar="PROMPT", show_default=False,
        help="prompt text; - reads it from stdin, as does a piped stdin when no prompt is given")] = None,
    prompt: Annotated[str | None, typer.Option(help="prompt text (the same as PROMPT; - reads stdin)")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    *,
    max_tokens: Annotated[int, checks.number_option(low=1, help="maximum new tokens")] = 128,
    temperature: Annotated[float, checks.number_option(kind=float, low=0, help="0 = greedy")] = 0.0,
    top_k: Annotated[int, checks.number_option(low=0, help="0 = off")] = 0,
    top_p: Annotated[float, checks.number_option(kind=float, above=0, high=1, help="nucleus mass")] = 1.0,
    seed: Annotated[int | None, checks.number_option(low=-(2**63), high=2**63 - 1, help=SEED_HELP)] = None,
    threads: Annotated[int | None, checks.number_option(low=1, high=checks.MAX_THREADS,
                                                        help="onnxruntime intra-op threads (default: one per physical core)")] = None,
    backend: Annotated[str, typer.Option(help="auto (TensorRT when an engine for this GPU exists) | "
                                              "onnxruntime | tensorrt")] = "auto",
    speculative: Annotated[str | None, typer.Option(
        help="speculative decoding: ngram | layerskip:N | draft:BUNDLE | mtp")] = None,
    spec_tokens: Annotated[int | None, checks.number_option(low=1, high=16,
                                                           help="most tokens proposed per step (default 8)")] = None,
    lora: Annotated[str | None, typer.Option(help="generate with this adapter of the bundle (`lineside lora list`)")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="with --chat: this Jinja template instead of the bundle's (a file, the text, or builtin:NAME)")] = None,
    system: Annotated[str | None, typer.Option(help="with --chat: a system prompt before the prompt")] = None,
    system_file: Annotated[Path | None, typer.Option(
        help="with --chat: read the system prompt from this UTF-8 file (instead of --system)")] = None,
) -> None:
    """Generate text from a prompt, streaming it to stdout.

    The prompt is PROMPT, --prompt, or stdin (PROMPT -, or piped with no prompt given: `lineside generate BUNDLE < prompt.txt`; its trailing newlines are dropped)."""
    from lineside.runtime.detokenize import IncrementalDetokenizer
    from lineside.runtime.sampling import SamplingParams, sampler_seed
    from lineside.runtime.speculative.config import parse_speculative

    if chat_template is not None and not chat:
        raise LinesideError("--chat-template needs --chat (the prompt is otherwise given to the model as it is)")
    if not chat and (system is not None or system_file is not None):
        raise LinesideError(f"{SYSTEM_OPTION[system_file is not None]} needs --chat (a system prompt is a chat "
                            "template's message; the prompt is otherwise given to the model as it is)")
    from lineside.runtime.prompt_input import prompt_text
    from lineside.runtime.system_input import system_text

    system = system_text(system, system_file)

    given = "--prompt" if prompt is not None else "PROMPT"
    prompt = prompt_text(prompt_arg, prompt)  # before the model loads: a missing or unreadable prompt is one line
    prompt = strip_invisible(checks.utf8_text(prompt, given))  # as the server strips a request's text
    _check_stdout("generate")
    template = _chat_template(chat_template)
    spec = parse_speculative(speculative, spec_tokens)
    if spec is not None and lora is not None:
        raise LinesideError("--speculative does not run with --lora; drop one of them")
    if spec is not None:
        from lineside.bundle import open_bundle
        from lineside.runtime.speculative.proposers import check_proposer

        check_proposer(spec, open_bundle(bundle, verify=False))
    if not prompt and not chat:
        _check_empty_prompt(bundle)
    gen = _generator(bundle, backend, threads, lora)
    gen.speculative = spec
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=sampler_seed(seed))
    tok = gen.tokenizer
    if template is not None:
        tok.chat_template = template
    if chat and not tok.chat_template:
        print(NO_TEMPLATE_NOTE, file=sys.stderr)
    ids = _prompt_ids(tok, prompt, chat, gen.backend.max_seq_len, system)
    detok = IncrementalDetokenizer(tok, prompt_ids=ids)
    made = 0
    try:
        for t in gen.stream(ids, max_tokens, params):
            made += 1
            sys.stdout.write(detok.add(t))
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: what was generated ends its line (the shell prompt gets its own)
        sys.stdout.write(detok.flush() + "\n")
        sys.stdout.flush()
        raise
    sys.stdout.write(detok.flush() + "\n")
    limit = gen.backend.max_seq_len
    if made < max_tokens and len(ids) + made >= limit:  # not EOS, not --max-tokens: the context ran out
        print(f"note: stopped after {made} tokens at the bundle's context of {limit} tokens (prompt {len(ids)}; "
              f"--max-tokens {max_tokens}); build the bundle with a larger --max-seq-len for longer output",
              file=sys.stderr)
    if spec is not None and gen.steps:
        n = gen.accepted + gen.steps  # each decode step adds its kept drafts and one sampled token
        print(f"speculative {spec.label}: {gen.accepted}/{gen.drafted} proposed tokens accepted, "
              f"{n / gen.steps:.2f} tokens per step", file=sys.stderr)


def chat(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    system_file: Annotated[Path | None, typer.Option(
        help="read the system prompt from this UTF-8 file (instead of --system)")] = None,
    max_tokens: Annotated[int, checks.number_option(low=1, help="maximum new tokens per answer")] = 256,
    *,
    temperature: Annotated[float, checks.number_option(kind=float, low=0, help="0 = greedy")] = 0.0,
    seed: Annotated[int | None, checks.number_option(low=-(2**63), high=2**63 - 1, help=SEED_HELP)] = None,
    threads: Annotated[int | None, checks.number_option(low=1, high=checks.MAX_THREADS,
                                                        help="onnxruntime intra-op threads (default: one per physical core)")] = None,
    backend: Annotated[str, typer.Option(help="auto (TensorRT when an engine for this GPU exists) | "
                                              "onnxruntime | tensorrt")] = "auto",
    lora: Annotated[str | None, typer.Option(help="chat with this adapter of the bundle (`lineside lora list`)")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="this Jinja template instead of the bundle's (a file, the text, or builtin:NAME)")] = None,
) -> int:
    """Chat with a bundle in the terminal, or answer piped lines a turn each.

    Ctrl-C stops an answer; an empty line, Ctrl-D or Ctrl-C at the prompt quits. Piped input: each line is a turn, blank lines are skipped, the end of the input quits, and stdout
    holds only the answers, each on a line of its own starting `model> ` (no `you> ` prompts); a line that
    cannot be answered is skipped with its error on stderr (naming the line), and the exit status is then 1."""
    from lineside.runtime.detokenize import IncrementalDetokenizer
    from lineside.runtime.sampling import SamplingParams, sampler_seed
    from lineside.runtime.system_input import system_text

    system = system_text(system, system_file)  # before the model loads: a missing or unreadable file is one line
    if sys.stdin is None or sys.stdin.closed:  # started with fd 0 closed (`<&-`, some service managers)
        raise LinesideError("chat reads what you type from stdin, and stdin is closed; run it in a terminal, pipe "
                            "the lines into it, or use `lineside generate --prompt TEXT`")
    _check_stdout("chat")
    template = _chat_template(chat_template)
    gen = _generator(bundle, backend, threads, lora)
    if template is not None:
        gen.tokenizer.chat_template = template
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    params = SamplingParams(temperature=temperature, seed=sampler_seed(seed))  # each answer samples from it anew
    limit = gen.backend.max_seq_len
    fixed = len(gen.tokenizer.encode_chat([*messages, {"role": "user", "content": ""}]))
    if fixed >= limit - 1:  # no line could be answered: say so once, not "type a shorter one" after every line
        what, fix = ((SYSTEM_OPTION[system_file is not None], "system prompt") if system else
                     ("the chat template", "--chat-template"))
        raise LinesideError(f"{what} makes a prompt of {fixed} tokens before anything is typed, and the bundle's "
                            f"context is {limit}; give a shorter {fix} (or build with a larger --max-seq-len)")
    # at a terminal an empty line quits; piped lines (a file of questions) are each a turn until the input ends, and
    # a blank line between them is skipped (it quit there, dropping every question after it without a word)
    typed = sys.stdin.isatty()
    print(f"chatting with {gen.bundle.config.name or bundle} — "
          f"{'empty line to quit' if typed else 'each line of stdin is a turn, until its end'}", file=sys.stderr)
    if not gen.tokenizer.chat_template:
        print(NO_TEMPLATE_NOTE.replace("--chat falls", "chat falls"), file=sys.stderr)
    if typed and sys.stdout.isatty():  # input() edits lines (arrows, history) only with readline loaded
        try:
            import readline  # noqa: F401
        except ImportError:  # a Python built without it: lines are read as before
            pass
    # the room an answer is given before older turns are forgotten: all of --max-tokens, up to a quarter of the
    # context (more would forget the whole conversation at every turn of a small bundle)
    reserve = min(max_tokens, limit // 4)
    forgetting = False
    skipped = 0  # piped lines refused (too long, not UTF-8): the answers file lacks them, so the exit says so
    number = 0  # of the line read (blank ones too): a piped line's error names it, as a compiler names a file's
    while True:
        number += 1
        try:
            # the prompt is for someone typing: piped, it was written before every line read (skipped blank ones
            # too), glued to the answers ("you> you> model> ..."), and stdout holds only the answers
            line = strip_invisible(checks.utf8_text((input(YOU) if typed else _piped_line()), "the chat line")).strip()
        except (EOFError, KeyboardInterrupt) as e:  # Ctrl-D / Ctrl-C at the prompt: quit on a fresh line
            if typed or isinstance(e, KeyboardInterrupt):
                sys.stdout.write("\n")
            if isinstance(e, KeyboardInterrupt):
                raise
            break
        except (LinesideError, UnicodeDecodeError):  # a strict UTF-8 stdin raises the latter
            # one line, and the conversation goes on: a mistyped line must not lose what was said so far
            fix = ("type it again in UTF-8 (the terminal's encoding)" if typed else
                   "it was skipped (convert the input to UTF-8 first, e.g. iconv -f latin1 -t utf-8)")
            print(f"error: {'the chat line' if typed else f'line {number}'} is not valid UTF-8 text; {fix}",
                  file=sys.stderr)
            skipped += 1
            continue
        if not line:
            if typed:
                break
            continue
        turns = [*messages, {"role": "user", "content": line}]
        alone = _line_too_long(gen.tokenizer, [*messages[:1 if system else 0], turns[-1]], limit)
        if alone is not None:  # a long line past the context alone: known from its first part, as serve knows
            print(f"error: {_line_error(alone, typed, number, limit)}", file=sys.stderr)
            skipped += 1
            continue
        ids = gen.tokenizer.encode_chat(turns)
        room = limit - len(ids)
        while room < reserve and len(turns) > 2:  # forget the oldest turns when the context fills up
            turns = turns[:1] + turns[3:] if system else turns[2:]
            ids = gen.tokenizer.encode_chat(turns)
            room = limit - len(ids)
        if room < 1:  # this line alone fills the context: say so, and keep the conversation as it was
            print(f"error: {_line_error(f'{len(ids)} tokens', typed, number, limit)}", file=sys.stderr)
            skipped += 1
            continue
        if len(turns) <= len(messages) and not forgetting:  # once: the model no longer sees the start, and why
            forgetting = True
            print(f"note: the conversation outgrew the bundle's context of {limit} tokens; from here on the oldest "
                  f"turns are forgotten{' (the system prompt is kept)' if system else ''}", file=sys.stderr)
        messages = turns
        detok = IncrementalDetokenizer(gen.tokenizer, prompt_ids=ids)
        sys.stdout.write("model> ")
        answer, stopped, made = [], False, 0
        try:
            for t in gen.stream(ids, min(max_tokens, room), params):
                made += 1
                piece = detok.add(t)
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt as e:  # Ctrl-C stops this answer (llama-cli -cnv, ollama run); the chat goes on
            if type(e) is not KeyboardInterrupt:  # SIGTERM (cli.Terminated) still ends the chat
                raise
            stopped = True
        tail = detok.flush()
        answer.append(tail)
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        if stopped:  # what was shown stays in the conversation
            print("answer stopped (Ctrl-C); an empty line or Ctrl-D quits", file=sys.stderr)
        elif room < max_tokens and made >= room:  # not EOS, not --max-tokens: the context ran out mid-answer
            print(f"note: the answer was cut after {made} tokens: with the prompt ({len(ids)} tokens) it filled the "
                  f"bundle's context of {limit}; say less per line (or in --system), or build the bundle with a "
                  "larger --max-seq-len", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(answer)})
    return 1 if skipped and not typed else 0


def _prompt_ids(tok: Any, prompt: str, chat: bool, limit: int, system: str | None = None) -> list[int]:
    """The prompt's ids (with --chat, after ``system`` as the template's system message), counted with an early stop
    at the context (runtime/bounded_encode, as the server counts them): refusing a 30 MB prompt costs the context's
    worth of tokenizing, not the whole text's."""
    from lineside.runtime.bounded_encode import PromptTooLong

    most = max(limit - 1, 0)  # one more and nothing can be generated (Generator.stream's rule)
    head = [{"role": "system", "content": system}] if chat and system else []
    try:
        if chat:
            return tok.encode_chat([*head, {"role": "user", "content": prompt}], max_tokens=most)
        return tok.encode(prompt, max_tokens=most)
    except PromptTooLong as e:
        chars = len(prompt)  # what was counted: the text, or the text in the template's markup
        if chat:
            chars += len(tok.apply_chat_template([*head, {"role": "user", "content": ""}]))
        raise LinesideError(too_long_text(e, chars, limit)) from None


def counted_size(e: Any, chars: int) -> str:
    """How long a prompt refused while it was counted is: all of it read, a lower bound (counted, or bounded from
    its bytes); else its first part's count and an estimate for the whole, said to be one."""
    if e.chars_read >= chars:
        return f"at least {e.tokens} tokens ({chars} characters)"
    about = round(e.tokens * chars / max(e.chars_read, 1))
    return (f"about {about} tokens (estimated: its first {e.chars_read} of {chars} characters already make "
            f"{e.tokens}; the rest was not tokenized)")


def too_long_text(e: Any, chars: int, limit: int) -> str:
    """One line for a prompt refused while it was counted (``counted_size``)."""
    return (f"the prompt has {counted_size(e, chars)}, and the bundle's context is {limit} tokens, which leaves no "
            "room to generate; shorten it (or build the bundle with a larger --max-seq-len)")


def _check_empty_prompt(bundle_path: Path) -> None:
    """An empty prompt is a BOS token alone, or nothing when the tokenizer adds none (Qwen2's, SmolLM2's): refused
    then from the tokenizer only, before the model loads (which takes seconds for a real one)."""
    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer

    if not Tokenizer.from_bundle(open_bundle(bundle_path, verify=False)).encode(""):
        raise LinesideError("the prompt is empty, and this bundle's tokenizer adds no BOS token, so the model has "
                            "nothing to continue; give some text (or --chat, to wrap it in the chat template)")


def _piped_line() -> str:
    """The next line of a piped stdin, decoded on its own: stdin's text layer decodes ahead in 8 KiB chunks, so one
    Latin-1 byte lost every line of the chunk around it (all of a short questions file), not just its own line."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes under it (tests, embedding): already decoded
        return input()
    raw = buffer.readline()
    if not raw:
        raise EOFError
    return raw.decode("utf-8").rstrip("\r\n")


def _line_too_long(tok: Any, turns: list[dict[str, str]], limit: int) -> str | None:
    """How long a long chat line's prompt is (with the system prompt) when it cannot fit the context even alone,
    counted with an early stop (runtime/bounded_encode): a 30 MB piped line is not tokenized whole to refuse it;
    None when it fits, or is short enough that the exact count that follows costs as little."""
    from lineside.runtime.bounded_encode import PromptTooLong

    if len(turns[-1]["content"]) <= limit:
        return None
    try:
        tok.encode_chat(turns, max_tokens=max(limit - 1, 0))
    except PromptTooLong as e:
        return counted_size(e, len(turns[-1]["content"]))
    return None


def _line_error(size: str, typed: bool, number: int, limit: int) -> str:
    """One line for a chat line whose prompt (``size``: its tokens) leaves no room to answer: at a terminal, type a
    shorter one; piped (a file of questions), which line was skipped and what fits."""
    if typed:
        return (f"that message makes a prompt of {size}, and the bundle's context is {limit}; type a shorter one "
                "(or build with a larger --max-seq-len)")
    return (f"line {number} makes a prompt of {size}, and the bundle's context is {limit} tokens, which leaves no "
            "room to answer; it was skipped (shorten that line, or build the bundle with a larger --max-seq-len)")


def _check_stdout(command: str) -> None:
    """One line before the model loads when fd 1 is closed (`>&-`, some service managers): Python then has no
    sys.stdout, and the first write of the answer died on an AttributeError (input() on "lost sys.stdout")."""
    if sys.stdout is None or sys.stdout.closed:
        raise LinesideError(f"{command} writes the model's text to stdout, and stdout is closed; redirect it to a file "
                            "(> out.txt) or to /dev/null")


def _chat_template(value: str | None) -> str | None:
    """--chat-template's text, checked before the model loads (one line when unreadable or broken)."""
    if value is None:
        return None
    from lineside.runtime.chat_template import template_option

    return template_option(value)


def _generator(bundle_path: Path, backend: str, threads: int | None, lora: str | None = None) -> Any:
    """A one-slot Generator on the backend --backend picks (the choice goes to stderr when not asked for);
    ``lora``: the bundle's adapter of that name in the backend's one adapter slot, used by every step."""
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import Generator
    from lineside.runtime.select import choose_backend

    backend = checks.choice(backend, "--backend", BACKENDS)
    b = open_bundle(bundle_path)
    adapter, slots = None, None
    if lora is not None:
        from lineside.runtime.adapters import bundle_adapter
        from lineside.runtime.lora_stack import LoraSlotsConfig

        adapter = bundle_adapter(b, lora)  # one line for a name the bundle does not carry
        # the bundle's slot rank: what a TensorRT engine built with --max-loras 1 holds
        rank = max(adapter.rank, b.manifest.lora.max_rank if b.manifest.lora is not None else 0)
        slots = LoraSlotsConfig(max_loras=1, max_rank=rank)
    say = (lambda msg: None) if backend == "onnxruntime" else (lambda msg: print(msg, file=sys.stderr))
    gen = Generator(b, backend=choose_backend(b, backend, num_slots=1, say=say, threads=threads, lora=slots))
    if adapter is not None:
        gen.backend.load_adapter(1, adapter)
        gen.adapter = 1
    return gen


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
    app.command("logits")(logits)
    app.command("generate")(generate)
