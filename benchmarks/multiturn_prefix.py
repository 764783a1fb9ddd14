"""Multi-turn chat through `lineside serve`: how much of turn N's prompt the prefix cache gives, and TTFT.

A chat app sends turn N as turn N-1's messages + the assistant's answer + a new user message, rendered by the
chat template. Per turn this prints the prompt tokens, ``usage.prompt_tokens_details.cached_tokens`` and the time
to the first streamed token, for each conversation kind: greedy or sampled, answers ended by the end-of-turn token
or cut by max_tokens, with or without a system message. The ceiling (what the ids allow, as vLLM's automatic
prefix caching reuses) is turn N-1's prompt + its answer's ids up to where the template renders them otherwise;
``ceiling`` prints it from /tokenize. Each turn starts after a pause (``--think``: a user reading and typing).
Greedy answers are also compared against a fresh server's answers to the same conversation (``--check``).

  PYTHONPATH=$PWD python benchmarks/multiturn_prefix.py --bundle /work/main/bundles/smollm2-w4a16 --turns 6

Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineside.bench.inprocess import free_port, wait_ready  # noqa: E402

QUESTIONS = ("What is a torque wrench used for?", "How often should it be calibrated?",
             "Write two sentences about safety on the line.", "What does a lineside buffer hold?",
             "Give three tips for a clean workstation.", "Summarise our chat in one line.")


@dataclass(frozen=True)
class Kind:
    name: str
    temperature: float
    max_tokens: int
    system: bool


KINDS = (Kind("greedy, ends by EOS", 0.0, 200, False), Kind("greedy, cut (max_tokens 24)", 0.0, 24, False),
         Kind("sampled, system prompt", 0.8, 200, True), Kind("greedy, system, cut", 0.0, 24, True))


class Server:
    def __init__(self, bundle: Path, threads: int):
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(bundle), "--host", "127.0.0.1",
                                      "--port", str(self.port), "--threads", str(threads), "--log-level", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.url, 600, alive=lambda: self.proc.poll() is None)
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def turn(self, messages: list[dict], kind: Kind, seed: int) -> tuple[str, dict, float]:
        body = {"model": self.model, "messages": messages, "max_tokens": kind.max_tokens, "stream": True,
                "temperature": kind.temperature, "seed": seed, "stream_options": {"include_usage": True}}
        t0, ttft, text, usage = time.perf_counter(), None, [], {}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    piece = c.get("delta", {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
        return "".join(text), usage, (ttft or 0.0) * 1e3

    def ceiling(self, prev: list[dict], answer: str, messages: list[dict]) -> int:
        """Turn N's tokens that equal turn N-1's prompt + its answer's ids (rendering vs generation): the most any
        prefix cache could reuse."""
        def ids(body: dict) -> list[int]:
            return httpx.post(self.url + "/tokenize", json={"model": self.model, **body}, timeout=30).json()["tokens"]
        before = ids({"messages": prev, "add_generation_prompt": True})
        gen = ids({"prompt": answer, "add_special_tokens": False})
        now = ids({"messages": messages, "add_generation_prompt": True})
        ref = before + gen
        n = 0
        while n < min(len(ref), len(now)) and ref[n] == now[n]:
            n += 1
        return n


def conversation(srv: Server, kind: Kind, turns: int, think: float) -> list[str]:
    messages = [{"role": "system", "content": "You are a concise assistant on a factory floor."}] if kind.system else []
    answers = []
    print(f"\n{kind.name}\n  turn  prompt  cached  ceiling  ttft_ms")
    prev: list[dict] | None = None
    for t in range(turns):
        if prev is not None:
            time.sleep(think)  # the user reads and types: the server is idle
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        ceil = srv.ceiling(prev, answers[-1], messages) if prev is not None else 0
        answer, usage, ttft = srv.turn(messages, kind, seed=t)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"  {t + 1:4d}  {usage.get('prompt_tokens', 0):6d}  {cached:6d}  {ceil:7d}  {ttft:7.1f}")
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
        prev = list(messages[:-1])
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--think", type=float, default=1.0, help="seconds between turns (the server idles)")
    ap.add_argument("--check", action="store_true", help="greedy answers vs a fresh server per turn's prompt")
    a = ap.parse_args()
    srv = Server(a.bundle, a.threads)
    try:
        got = {k.name: conversation(srv, k, a.turns, a.think) for k in KINDS}
    finally:
        srv.stop()
    if a.check:
        for k in KINDS:
            if k.temperature:
                continue
            fresh = Server(a.bundle, a.threads)
            try:
                messages = [{"role": "system", "content": "You are a concise assistant on a factory floor."}] \
                    if k.system else []
                same = True
                for t, answer in enumerate(got[k.name]):
                    messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                    alone, _, _ = fresh.turn(messages, k, seed=t)
                    same &= alone == answer
                    messages.append({"role": "assistant", "content": answer})
                    fresh.stop()
                    fresh = Server(a.bundle, a.threads)
                print(f"{k.name}: answers equal a fresh server's: {same}")
            finally:
                fresh.stop()


if __name__ == "__main__":
    main()
