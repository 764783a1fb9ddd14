"""`lineside logits` and `lineside generate`: the direct single-stream paths."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from lineside.errors import LinesideError


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise LinesideError(f"--ids {text!r}: give comma-separated integers, e.g. 1,2,3") from None


def logits(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    ids: Annotated[str, typer.Option(help="comma-separated token ids")],
    output: Annotated[Path, typer.Option("-o", "--output", help=".npy file for float32 logits [T, vocab]")],
    *,
    mode: Annotated[str, typer.Option(help="prefill (one step) | decode (one token per step via the cache)")] = "prefill",
    flavor: Annotated[str, typer.Option(help="graph flavor to run: cpu | trt")] = "cpu",
    threads: Annotated[int | None, typer.Option(help="onnxruntime intra-op threads")] = None,
) -> None:
    """Write float32 logits for every position (parity checks against a reference)."""
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    token_ids = _parse_ids(ids)
    if not token_ids:
        raise LinesideError("--ids is empty; give at least one token id")
    b = open_bundle(bundle)
    be = OnnxRuntimeBackend(b, num_slots=1, flavor=flavor, threads=threads,
                            accuracy_level=0 if flavor == "trt" else None)
    out = compute_logits(be, token_ids, mode)
    np.save(output, out.astype(np.float32))
    print(f"{output}: logits {list(out.shape)} ({mode}, {flavor})")


def generate(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    prompt: Annotated[str, typer.Option(help="prompt text")],
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    *,
    max_tokens: Annotated[int, typer.Option(help="maximum new tokens")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option(help="random seed (same seed, same output)")] = None,
    threads: Annotated[int | None, typer.Option(help="onnxruntime intra-op threads")] = None,
    backend: Annotated[str, typer.Option(help="auto (TensorRT when an engine for this GPU exists) | "
                                              "onnxruntime | tensorrt")] = "auto",
    speculative: Annotated[str | None, typer.Option(help="speculative decoding: ngram (prompt lookup)")] = None,
    spec_tokens: Annotated[int | None, typer.Option(help="most tokens proposed per step (1-16, default 4)")] = None,
) -> None:
    """Generate text from a prompt, streaming it to stdout."""
    from lineside.runtime.detokenize import IncrementalDetokenizer
    from lineside.runtime.sampling import SamplingParams
    from lineside.runtime.speculative.config import parse_speculative

    if max_tokens < 1:
        raise LinesideError("--max-tokens must be at least 1")
    spec = parse_speculative(speculative, spec_tokens)
    gen = _generator(bundle, backend, threads)
    gen.speculative = spec
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    tok = gen.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    detok = IncrementalDetokenizer(tok)
    for t in gen.stream(ids, max_tokens, params):
        sys.stdout.write(detok.add(t))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if spec is not None and gen.steps:
        n = gen.accepted + gen.steps  # each decode step adds its kept drafts and one sampled token
        print(f"speculative {spec.method}: {gen.accepted}/{gen.drafted} proposed tokens accepted, "
              f"{n / gen.steps:.2f} tokens per step", file=sys.stderr)


def chat(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    max_tokens: Annotated[int, typer.Option(help="maximum new tokens per answer")] = 256,
    *,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    threads: Annotated[int | None, typer.Option(help="onnxruntime intra-op threads")] = None,
    backend: Annotated[str, typer.Option(help="auto (TensorRT when an engine for this GPU exists) | "
                                              "onnxruntime | tensorrt")] = "auto",
) -> None:
    """Interactive chat in the terminal (empty line or Ctrl-D to quit)."""
    from lineside.runtime.detokenize import IncrementalDetokenizer
    from lineside.runtime.sampling import SamplingParams

    gen = _generator(bundle, backend, threads)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    params = SamplingParams(temperature=temperature)
    print(f"chatting with {gen.bundle.config.name or bundle} — empty line to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        ids = gen.tokenizer.encode_chat(messages)
        room = gen.backend.max_seq_len - len(ids) - 1
        while room < 16 and len(messages) > 2:  # forget the oldest turns when the context fills up
            messages = messages[:1] + messages[3:] if system else messages[2:]
            ids = gen.tokenizer.encode_chat(messages)
            room = gen.backend.max_seq_len - len(ids) - 1
        detok = IncrementalDetokenizer(gen.tokenizer)
        sys.stdout.write("model> ")
        answer = []
        for t in gen.stream(ids, min(max_tokens, max(room, 1)), params):
            piece = detok.add(t)
            answer.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        tail = detok.flush()
        answer.append(tail)
        sys.stdout.write(tail + "\n")
        messages.append({"role": "assistant", "content": "".join(answer)})


def _generator(bundle_path: Path, backend: str, threads: int | None) -> Any:
    """A one-slot Generator on the backend --backend picks (the choice goes to stderr when not asked for)."""
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import Generator
    from lineside.runtime.select import choose_backend

    b = open_bundle(bundle_path)
    say = (lambda msg: None) if backend == "onnxruntime" else (lambda msg: print(msg, file=sys.stderr))
    return Generator(b, backend=choose_backend(b, backend, num_slots=1, say=say, threads=threads))


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
    app.command("logits")(logits)
    app.command("generate")(generate)
