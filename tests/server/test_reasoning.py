"""``serve --reasoning-parser deepseek_r1``: an R1-Distill model's thinking in ``reasoning_content`` (and vLLM's newer
``reasoning``), its answer alone in ``content``, streamed and not, n > 1, logprobs unchanged; tool calls and
structured outputs on the answer only (the grammar starts after ``</think>``); /v1/responses' reasoning item.

No R1 model can be installed here, so a scripted backend plays one: through R1-Distill's real chat template (which
opens ``<think>\\n`` in the generation prompt), a tokenizer with R1's added tokens (``<think>``/``</think>`` and the
role markers, not special, as released), the engine, the detokenizer and the server, to the real ``openai``
client. The script is forced by its logits, so a grammar applied too early shows as a garbled output."""

from __future__ import annotations

import json
import shutil

import numpy as np
import openai
import pytest

from tests.runtime.fakes import FakeBackend
from tests.server.conftest import running_server

# DeepSeek-R1-Distill-Qwen / -Llama's chat template, as their tokenizer_config.json ships it (one line there).
R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' "
    "+ tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}"
    "{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")

CONTEXT = 2048  # one token per byte: the tools' system prompt alone is ~600
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
CALLS = "<｜tool▁calls▁begin｜>"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather at a place",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SCRIPTS = {  # what the model writes after the template's "<｜Assistant｜><think>\n"
    "[think]": "The user asks 2+2.\nThat is 4.\n</think>\n\nIt is 4.",
    "[own-open]": "<think>\nHmm, <tool_call> is only a thought.\n</think>The answer.",  # writes its own <think>
    "[unclosed]": "Thinking and thinking",
    "[empty-answer]": "Done thinking.</think>",
    "[json]": 'They want JSON.\n</think>{"city": "Lyon"}',
    "[choice]": "Pick one.\n</think>yes",
    # R1's own call markup (the template's); one the model only thinks about stays reasoning
    "[tool]": f'I should call {CALLS} in my head only.\n</think>\n\n{CALLS}<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
              'get_weather\n```json\n{"city": "Lyon"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "[args]": 'Arguments next.\n</think>{"city": "Lyon"}',
}
SPLIT = {  # (reasoning, content) as vLLM's deepseek_r1 parser splits each script
    "[think]": ("The user asks 2+2.\nThat is 4.\n", "\n\nIt is 4."),
    "[own-open]": ("\nHmm, <tool_call> is only a thought.\n", "The answer."),
    "[unclosed]": ("Thinking and thinking", None),
    "[empty-answer]": ("Done thinking.", None),
    "[json]": ("They want JSON.\n", '{"city": "Lyon"}'),
}


class ThinkingModel(FakeBackend):
    """Plays R1-Distill: after the prompt's last "<｜Assistant｜><think>\\n", the script named in the last user turn,
    token by token, then EOS (logits -1e9 but for the script's token: a grammar mask that forbids it shows)."""

    def __init__(self, tokenizer, scripts: dict[str, str] | None = None, **kw):
        super().__init__(**kw)
        self.tok, self.scripts = tokenizer, SCRIPTS if scripts is None else scripts
        self.turn = tokenizer.encode(ASSISTANT + "<think>\n", add_special=False)
        self.eos = tokenizer.eos_token_ids[0]

    def logits(self, seq: list[int]) -> np.ndarray:
        n = len(self.turn)
        starts = [i for i in range(len(seq) - n + 1) if seq[i:i + n] == self.turn]
        x = np.full(self.vocab_size, -1e9, dtype=np.float32)
        if not starts:
            return x
        cut = starts[-1] + n
        last_user = self.tok.decode(seq[:cut], skip_special=False).rsplit(USER, 1)[-1]
        key = next((k for k in self.scripts if k in last_user), None)
        script = self.tok.encode(self.scripts[key], add_special=False) if key else []
        i = len(seq) - cut
        x[script[i] if i < len(script) else self.eos] = 0.0
        return x


def _bundle(tiny_dense, tmp_path, special_tags: bool = False):
    """``special_tags``: ``<think>``/``</think>`` marked special (as Qwen3-style vocabularies may), so decoding drops
    their text and only ``</think>``'s id ends the reasoning."""
    from tokenizers import AddedToken, Tokenizer

    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dense("llama-gqa"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": CONTEXT}))
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tags = ["<think>", "</think>"]
    tok.add_special_tokens([AddedToken(t, special=True) for t in [BOS, EOS, *(tags if special_tags else [])]])
    # as released: the role markers and the think tags are added tokens not marked special (they show in the text)
    tok.add_tokens([AddedToken(t, special=False) for t in [USER, ASSISTANT, *([] if special_tags else tags),
                                                           "<tool_call>", "</tool_call>"]])
    assert tok.get_vocab_size() <= 300  # the checkpoint's vocabulary
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "chat_template": R1_TEMPLATE}))
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}))
    return build_bundle(ckpt, tmp_path / "r1", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=CONTEXT))


@pytest.fixture(scope="module")
def r1_bundle(tiny_dense, tmp_path_factory):
    return _bundle(tiny_dense, tmp_path_factory.mktemp("r1"))


def _serve(bundle, speculative=None, **app_kw):
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(bundle)
    be = ThinkingModel(Tokenizer.from_bundle(b), num_slots=4, max_seq_len=CONTEXT)
    return running_server(LLMEngine(b, backend=be, num_slots=4, speculative=speculative), **app_kw)


@pytest.fixture(scope="module")
def r1(r1_bundle):
    with _serve(r1_bundle, reasoning_parser="deepseek_r1") as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        yield srv


def _ask(srv, script: str, **kw):
    kw.setdefault("messages", [{"role": "user", "content": f"{script} What is 2+2?"}])
    kw.setdefault("max_tokens", 300)
    return srv.client.chat.completions.create(model="r1", temperature=0, **kw)


def _streamed(srv, script: str, **kw):
    """Per choice: (reasoning_content, reasoning, content, finish_reason) joined from the deltas."""
    out: dict[int, list] = {}
    for c in _ask(srv, script, stream=True, **kw):
        for ch in c.choices:
            e = out.setdefault(ch.index, ["", "", "", None])
            d = ch.delta.model_dump()
            assert "</think>" not in (d.get("content") or "") + (d.get("reasoning_content") or "")
            assert d.get("reasoning_content") == d.get("reasoning")  # vLLM's two names, kept in step
            e[0] += d.get("reasoning_content") or ""
            e[1] += d.get("reasoning") or ""
            e[2] += d.get("content") or ""
            e[3] = ch.finish_reason or e[3]
    return [tuple(out[i]) for i in sorted(out)]


@pytest.mark.parametrize("script", sorted(SPLIT))
def test_reasoning_and_answer_are_apart(r1, script):
    reasoning, content = SPLIT[script]
    m = _ask(r1, script).choices[0].message.model_dump()
    assert (m["reasoning_content"], m["reasoning"], m["content"]) == (reasoning, reasoning, content)
    ((r, r2, c, finish),) = _streamed(r1, script)
    assert (r, r2, c, finish) == (reasoning, reasoning, content or "", "stop")


def test_the_prompt_opens_the_think_block(r1):
    """R1's template ends the prompt inside ``<think>``: the output has only the closing tag (the model's text)."""
    from lineside.server.reasoning import ThinkTokens

    tok = r1.state.engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special=False).endswith(ASSISTANT + "<think>\n")
    think = ThinkTokens.of(tok)
    assert think.thinking_after(ids)


def test_n_choices_each_split(r1):
    r = _ask(r1, "[think]", n=2)
    assert [(c.message.model_dump()["reasoning_content"], c.message.content) for c in r.choices] == [SPLIT["[think]"]] * 2
    assert _streamed(r1, "[think]", n=2) == [(*SPLIT["[think]"][:1], SPLIT["[think]"][0], SPLIT["[think]"][1],
                                               "stop")] * 2


def test_logprobs_cover_every_token_reasoning_included(r1):
    """logprobs are the tokens the model wrote, as without the parser: reasoning, ``</think>`` and answer."""
    r = _ask(r1, "[think]", logprobs=True, top_logprobs=1)
    assert "".join(t.token for t in r.choices[0].logprobs.content) == SCRIPTS["[think]"]
    streamed = []
    for c in _ask(r1, "[think]", logprobs=True, top_logprobs=1, stream=True):
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
            streamed += [t.token for t in c.choices[0].logprobs.content]
    assert "".join(streamed) == SCRIPTS["[think]"]


def test_usage_counts_the_reasoning_tokens(r1):
    """OpenAI's usage.completion_tokens_details.reasoning_tokens: the tokens up to and including ``</think>`` (those
    of every choice), in the body and in the streamed usage chunk; the reasoning a request leaves out is counted
    still (it was generated)."""
    tok = r1.state.engine.tokenizer
    thought = len(tok.encode(SCRIPTS["[think]"].split("</think>")[0] + "</think>", add_special=False))
    for kw, want in (({}, thought), ({"n": 2}, 2 * thought), ({"extra_body": {"include_reasoning": False}}, thought),
                     ({"max_tokens": 5}, 5)):
        r = _ask(r1, "[think]", **kw)
        assert r.usage.completion_tokens_details.reasoning_tokens == want, kw
        assert r.usage.completion_tokens == want + (len(r.choices) * (len(tok.encode(SPLIT["[think]"][1],
                                                    add_special=False)) + 1) if "max_tokens" not in kw else 0)
        (last,) = [c for c in _ask(r1, "[think]", stream=True, stream_options={"include_usage": True}, **kw)
                   if c.usage is not None]
        assert last.usage.completion_tokens_details.reasoning_tokens == want, kw


def test_continuous_usage_counts_the_reasoning_tokens_so_far(r1):
    """With continuous_usage_stats each streamed chunk's usage carries completion_tokens_details.reasoning_tokens as
    the usage chunk does: the choice's tokens inside its reasoning so far (all of them until ``</think>``)."""
    tok = r1.state.engine.tokenizer
    thought = len(tok.encode(SCRIPTS["[think]"].split("</think>")[0] + "</think>", add_special=False))
    chunks = list(_ask(r1, "[think]", stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [(c.usage.completion_tokens, c.usage.completion_tokens_details) for c in chunks if c.choices]
    assert len(counted) > 2 and counted[-1][0] > thought, counted
    for completion, details in counted:
        assert details is not None and details.reasoning_tokens == min(completion, thought), counted
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought


@pytest.mark.parametrize("kw, reasoning, finish, stop_reason", [
    ({"max_tokens": 5}, "The u", "length", None),  # cut inside the reasoning: all reasoning, content null
    ({"stop": ["That"]}, "The user asks 2+2.\n", "stop", "That"),  # vLLM applies stops to the whole output
])
def test_an_output_that_ends_inside_the_reasoning(r1, kw, reasoning, finish, stop_reason):
    ch = _ask(r1, "[think]", **kw).choices[0]
    m = ch.message.model_dump()
    assert (m["reasoning_content"], m["content"], ch.finish_reason, ch.model_dump()["stop_reason"]) == (
        reasoning, None, finish, stop_reason)
    ((r, _, c, f),) = _streamed(r1, "[think]", **kw)
    assert (r, c, f) == (reasoning, "", finish)


@pytest.mark.parametrize("stop", [["</think>Z"], ["4.\n</think>\n\nX"]])
def test_a_stop_string_held_across_the_end_of_the_reasoning(r1, stop):
    """A stop string that may begin at ``</think>`` holds the tag's text back until a later token decides it: the
    reasoning still ends at the tag's text, which stays out of the answer, and the count ends at its token."""
    tok = r1.state.engine.tokenizer
    thought = len(tok.encode(SCRIPTS["[think]"].split("</think>")[0] + "</think>", add_special=False))
    r = _ask(r1, "[think]", stop=stop)
    m = r.choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"], r.choices[0].finish_reason) == (*SPLIT["[think]"], "stop")
    assert r.usage.completion_tokens_details.reasoning_tokens == thought
    ((rs, _, c, f),) = _streamed(r1, "[think]", stop=stop)
    assert (rs, c, f) == (*SPLIT["[think]"], "stop")


@pytest.fixture(scope="module")
def r1_hidden(tiny_dense, tmp_path_factory):
    """R1 played on a vocabulary whose think tags are special: ``</think>`` decodes to nothing."""
    with _serve(_bundle(tiny_dense, tmp_path_factory.mktemp("r1h"), special_tags=True),
                reasoning_parser="deepseek_r1") as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        yield srv


@pytest.mark.parametrize("stop, split, finish", [
    (None, SPLIT["[think]"], "stop"),
    (["4.\nZ"], SPLIT["[think]"], "stop"),  # "4.\n" held back when the hidden </think> comes: it is reasoning still
    (["4.\n\n\nX"], SPLIT["[think]"], "stop"),
    (["That is 4.\n\n"], ("The user asks 2+2.\n", None), "stop"),  # matched across the hidden tag, as vLLM's text
    (["4.\n\n\nIt"], ("The user asks 2+2.\nThat is ", None), "stop"),  # the held text is cut: reasoning alone
])
def test_a_held_stop_prefix_before_a_hidden_think_tag_stays_reasoning(r1_hidden, stop, split, finish):
    """A special ``</think>`` (no text) generated while a stop string holds the reasoning's last characters back
    ends the reasoning after them when they come: streamed, non-streamed and /v1/responses split alike."""
    kw = {} if stop is None else {"stop": stop}
    ch = _ask(r1_hidden, "[think]", **kw).choices[0]
    m = ch.message.model_dump()
    assert (m["reasoning_content"], m["content"], ch.finish_reason) == (*split, finish)
    ((r, _, c, f),) = _streamed(r1_hidden, "[think]", **kw)
    assert (r, c or None, f) == (*split, finish)
    out = r1_hidden.client.responses.create(model="r1", input="[think] What is 2+2?", temperature=0,
                                            extra_body=kw).output
    assert out[0].content[0].text == split[0]
    assert [o.content[0].text for o in out[1:]] == [t for t in split[1:] if t]


def test_include_reasoning_false_drops_it(r1):
    """vLLM's ``include_reasoning: false``: the answer alone, the reasoning neither returned nor streamed."""
    m = _ask(r1, "[think]", extra_body={"include_reasoning": False}).choices[0].message.model_dump()
    assert m["content"] == SPLIT["[think]"][1] and not m.get("reasoning_content") and not m.get("reasoning")
    ((r, _, c, _),) = _streamed(r1, "[think]", extra_body={"include_reasoning": False})
    assert (r, c) == ("", SPLIT["[think]"][1])


@pytest.mark.parametrize("fmt", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    {"response_format": {"type": "json_object"}},
    {"extra_body": {"guided_json": SCHEMA}},
])
def test_structured_output_starts_after_the_reasoning(r1, fmt):
    """vLLM with a reasoning parser: the grammar applies from ``</think>`` on; the reasoning is free text."""
    m = _ask(r1, "[json]", **fmt).choices[0].message
    assert m.model_dump()["reasoning_content"] == "They want JSON.\n"
    assert json.loads(m.content) == {"city": "Lyon"}
    ((r, _, c, finish),) = _streamed(r1, "[json]", **fmt)
    assert (r, json.loads(c), finish) == ("They want JSON.\n", {"city": "Lyon"}, "stop")


def test_speculative_proposals_across_the_end_of_the_reasoning(r1_bundle):
    """Prompt lookup proposes an earlier turn's output (in the prompt with its ``</think>`` token) across the tag:
    the grammar validates the drafts from the tag on, and a rejected tail rolls it back, past the tag too: the
    output is plain decoding's, with and without speculation."""
    import asyncio

    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import FinishReason, GenerationRequest
    from lineside.runtime.sampling import SamplingParams
    from lineside.runtime.speculative.config import parse_speculative
    from lineside.runtime.structured import Constraint
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(r1_bundle)
    tok = Tokenizer.from_bundle(b)
    end = tok.token_id("</think>")
    echo = SCRIPTS["[json]"].replace("Lyon", "Oslo").replace("JSON", "YAML")  # drafts that go wrong mid-way
    turn = ASSISTANT + "<think>\n"

    async def run(spec, before: str) -> tuple[str, FinishReason, int]:
        engine = LLMEngine(b, backend=ThinkingModel(tok, num_slots=2, max_seq_len=CONTEXT), num_slots=2,
                           speculative=spec)
        await engine.start()
        try:
            ids = tok.encode(f"{USER}[json] x{turn}{before}{EOS}{USER}[json] again{turn}", add_special=False)
            assert end in ids
            handle = engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=100, constraint=Constraint.json_object(),
                                                     constraint_after=end, sampling=SamplingParams(temperature=0)))
            text, _, last = await handle.result()
            return text, last.finish_reason, engine.stats().spec_accepted_tokens_total
        finally:
            await engine.stop(0.0)

    for before in (SCRIPTS["[json]"], echo):
        plain = asyncio.run(run(None, before))
        assert plain == (SCRIPTS["[json]"], FinishReason.STOP, 0)
        text, reason, accepted = asyncio.run(run(parse_speculative("ngram", 8), before))
        assert (text, reason) == plain[:2] and accepted > 0


def test_guided_choice_after_the_reasoning(r1):
    m = _ask(r1, "[choice]", extra_body={"guided_choice": ["yes", "no"]}).choices[0].message
    assert (m.model_dump()["reasoning_content"], m.content) == ("Pick one.\n", "yes")


def test_tool_calls_are_read_from_the_answer_only(r1):
    """A call the model only thinks about stays reasoning; the one in its answer (R1's markup, which its template
    writes, so ``auto`` reads it) is the call."""
    ch = _ask(r1, "[tool]", tools=TOOLS).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.model_dump()["reasoning_content"] == f"I should call {CALLS} in my head only.\n"
    (call,) = ch.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Lyon"})
    args, reasoning, finish = "", "", None
    for c in _ask(r1, "[tool]", tools=TOOLS, stream=True):
        for t in c.choices[0].delta.tool_calls or []:
            args += t.function.arguments or ""
        reasoning += c.choices[0].delta.model_dump().get("reasoning_content") or ""
        finish = c.choices[0].finish_reason or finish
    assert (json.loads(args), reasoning, finish) == ({"city": "Lyon"}, f"I should call {CALLS} in my head only.\n",
                                                     "tool_calls")
    m = _ask(r1, "[own-open]", tools=TOOLS).choices[0].message
    assert not m.tool_calls and m.content == "The answer."


def test_a_named_tool_call_is_constrained_after_the_reasoning(r1):
    ch = _ask(r1, "[args]", tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert ch.message.model_dump()["reasoning_content"] == "Arguments next.\n"
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Lyon"}


def test_the_next_turn_carries_the_answer_not_the_reasoning(r1):
    """The assistant message sent back (reasoning_content included, as clients echo it) renders as its answer."""
    first = _ask(r1, "[think]").choices[0].message
    history = [{"role": "user", "content": "[think] What is 2+2?"}, first.model_dump(exclude_none=True),
               {"role": "user", "content": "[json] And as JSON?"}]
    m = _ask(r1, "", messages=history, response_format={"type": "json_object"}).choices[0].message
    assert json.loads(m.content) == {"city": "Lyon"}


def test_without_the_parser_the_text_is_as_before(r1_bundle):
    """The default (no --reasoning-parser): the model's text whole in content, no reasoning fields."""
    with _serve(r1_bundle) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        m = _ask(srv, "[think]").choices[0].message.model_dump()
        assert m["content"] == SCRIPTS["[think]"] and "reasoning_content" not in m and "reasoning" not in m


def test_auto_turns_it_on_for_a_template_that_thinks(r1_bundle, tiny_bundle):
    with _serve(r1_bundle, reasoning_parser="auto") as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert _ask(srv, "[think]").choices[0].message.content == SPLIT["[think]"][1]
    with running_server(tiny_bundle, threads=1, reasoning_parser="auto") as srv:  # no <think>: off
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        m = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0).choices[0].message.model_dump()
        assert "reasoning_content" not in m


def test_deepseek_r1_on_a_tokenizer_without_think_tokens_is_one_line(tiny_bundle):
    from lineside.bundle import open_bundle
    from lineside.errors import LinesideError
    from lineside.runtime.tokenizer import Tokenizer
    from lineside.server.reasoning import resolve

    tok = Tokenizer.from_bundle(open_bundle(tiny_bundle))
    with pytest.raises(LinesideError, match="--reasoning-parser deepseek_r1.*</think>") as e:
        resolve("deepseek_r1", tok, tok.chat_template)
    assert "\n" not in str(e.value)
    assert resolve("auto", tok, tok.chat_template) is None and resolve("none", tok, tok.chat_template) is None


def test_serve_refuses_a_parser_it_cannot_run_in_one_line(tiny_bundle, tmp_path):
    """Before the socket opens and the model loads: an unknown name, or deepseek_r1 on a model without the tags."""
    from tests.cli.cli_run import assert_one_line_error, run_cli

    proc = run_cli("serve", tmp_path / "no-such-bundle", "--reasoning-parser", "qwen3")
    assert_one_line_error(proc, "--reasoning-parser", "deepseek_r1", code=1)
    proc = run_cli("serve", tiny_bundle, "--reasoning-parser", "deepseek_r1", "--port", "1")
    assert_one_line_error(proc, "--reasoning-parser deepseek_r1", "</think>", code=1)


def test_auto_reads_either_tag_in_the_template():
    """R1-Distill's first template opened no ``<think>`` (the model wrote it) but cut earlier turns at ``</think>``."""
    from lineside.server.reasoning import ThinkTokens, resolve

    class Tok:
        def token_id(self, text):
            return {"<think>": 10, "</think>": 11}.get(text)

    old = "{% set content = content.split('</think>')[-1] %}{{ content }}{% if add_generation_prompt %}A:{% endif %}"
    assert resolve("auto", Tok(), old) == ThinkTokens(10, 11)
    assert resolve("auto", Tok(), "{{ messages[0].content }}") is None


# ---- /v1/responses ---------------------------------------------------------------------------------------------
def test_responses_carry_a_reasoning_item(r1):
    r = r1.client.responses.create(model="r1", input="[think] What is 2+2?", temperature=0, max_output_tokens=300)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", SPLIT["[think]"][0])]
    assert message.type == "message" and r.output_text == SPLIT["[think]"][1]
    assert r.usage.output_tokens_details.reasoning_tokens == len(
        r1.state.engine.tokenizer.encode(SCRIPTS["[think]"].split("</think>")[0] + "</think>", add_special=False))
    events = list(r1.client.responses.create(model="r1", input="[think] What is 2+2?", temperature=0,
                                             max_output_tokens=300, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == SPLIT["[think]"][0]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == SPLIT["[think]"][1]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message")]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert final.output_text == SPLIT["[think]"][1] and final.output[0].content[0].text == SPLIT["[think]"][0]


@pytest.mark.parametrize("script, limit, status, text", [
    ("[think]", 5, "incomplete", "The u"),  # max_output_tokens spent inside the reasoning
    ("[empty-answer]", 300, "completed", "Done thinking."),  # nothing after </think>
])
def test_responses_without_an_answer_hold_the_reasoning_alone(r1, script, limit, status, text):
    """As OpenAI (a response cut while reasoning holds the reasoning item, no message) and vLLM (a message only
    when the answer has text): no empty message item after the reasoning, streamed or not."""
    ask = {"model": "r1", "input": f"{script} What is 2+2?", "temperature": 0, "max_output_tokens": limit}
    r = r1.client.responses.create(**ask)
    assert (r.status, [o.type for o in r.output], r.output[0].content[0].text, r.output_text) == (
        status, ["reasoning"], text, "")
    events = list(r1.client.responses.create(**ask, stream=True))
    assert [e.item.type for e in events if e.type in ("response.output_item.added", "response.output_item.done")] == [
        "reasoning", "reasoning"]
    final = events[-1].response
    assert (final.status, [o.type for o in final.output], final.output[0].content[0].text) == (
        status, ["reasoning"], text)
    assert final.output[0].status == ("incomplete" if status == "incomplete" else "completed")


def test_responses_logprobs_of_a_thinking_model_are_a_400(r1):
    """The thinking's tokens are not the message text's: logprobs are refused in one line, not mixed in."""
    with pytest.raises(openai.BadRequestError) as e:
        r1.client.responses.create(model="r1", input="[think] What is 2+2?", max_output_tokens=30,
                                   include=["message.output_text.logprobs"])
    assert e.value.body["param"] == "include" and "thinks" in e.value.body["message"]


def test_responses_json_format_after_the_reasoning(r1):
    r = r1.client.responses.create(model="r1", input="[json] weather?", temperature=0, max_output_tokens=300,
                                   text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}})
    assert json.loads(r.output_text) == {"city": "Lyon"} and r.output[0].content[0].text == "They want JSON.\n"


def test_responses_previous_turn_keeps_the_answer(r1):
    first = r1.client.responses.create(model="r1", input="[think] What is 2+2?", temperature=0, max_output_tokens=300)
    stored = r1.state.responses.get(first.id)
    assert stored.conversation[-1] == {"role": "assistant", "content": SPLIT["[think]"][1]}


def test_responses_output_handed_back_as_input(r1):
    """OpenAI's way of carrying a conversation by hand: the previous output items, reasoning item included, as the
    next input (the reasoning is dropped from the history, as R1's template drops it)."""
    first = r1.client.responses.create(model="r1", input="[think] What is 2+2?", temperature=0, max_output_tokens=300)
    context = [{"role": "user", "content": "[think] What is 2+2?"}, *first.output,
               {"role": "user", "content": "[json] And as JSON?"}]
    r = r1.client.responses.create(model="r1", input=context, temperature=0, max_output_tokens=300,
                                   text={"format": {"type": "json_object"}})
    assert json.loads(r.output_text) == {"city": "Lyon"}


def test_responses_function_calls_after_the_reasoning(r1):
    """/v1/responses with function tools: the reasoning item, then the call read from the answer only (the
    call markup the model only thinks about stays reasoning); a named function is constrained after the reasoning;
    streamed, the call's item comes after the reasoning's, at output_index 1."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = r1.client.responses.create(model="r1", input="[tool] weather?", tools=tools, temperature=0,
                                   max_output_tokens=300)
    reasoning, call = r.output
    assert reasoning.content[0].text == f"I should call {CALLS} in my head only.\n"
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Lyon"})
    events = list(r1.client.responses.create(model="r1", input="[tool] weather?", tools=tools, temperature=0,
                                             max_output_tokens=300, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "function_call")]
    assert json.loads("".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")) == {
        "city": "Lyon"}
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]
    named = r1.client.responses.create(model="r1", input="[args] weather?", tools=tools, temperature=0,
                                       max_output_tokens=300, tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in named.output] == ["reasoning", "function_call"]
    assert json.loads(named.output[1].arguments) == {"city": "Lyon"}


def test_the_slo_cache_keys_on_the_reasoning_options():
    """A cached answer with the reasoning is not served for include_reasoning: false (or the other way round)."""
    from lineside.server.outputs import OutputOptions
    from lineside.server.reasoning import Reasoning, ThinkTokens
    from lineside.server.slo.routing import output_key

    think = ThinkTokens(10, 11)
    keys = {output_key(OutputOptions(chat=True, reasoning=r)) for r in (
        None, Reasoning(think, True), Reasoning(think, True, include=False), Reasoning(think, False))}
    assert len(keys) == 4


# ---- the splitter on its own --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, thinking, want", [
    ("abc</think>xyz", True, ("abc", "xyz")),
    ("<think>abc</think>xyz", True, ("abc", "xyz")),
    ("abc", True, ("abc", None)),
    ("</think>", True, ("", None)),
    ("abc</think>xyz", False, (None, "abc</think>xyz")),  # the prompt already closed the reasoning
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("abc<think>", True, ("abc", None)),  # a whole <think> at the end is a tag, not a tag still coming
    ("<think><think>", True, ("", None)),
    ("a <thin", True, ("a <thin", None)),  # cut off while it looked like a tag: it was text
])
def test_split_whole_and_piece_by_piece_agree(text, thinking, want):
    from lineside.server.reasoning import ReasoningSplitter, ThinkTokens

    think = ThinkTokens(start_id=10, end_id=11)
    for size in (1, 2, 3, len(text)):
        s = ReasoningSplitter(think, thinking)
        r, c = "", ""
        for i in range(0, len(text), size):
            a, b = s.feed(text[i:i + size])
            r, c = r + a, c + b
        a, b = s.close()
        assert s.result() == want, size
        assert (r + a, c + b) == (want[0] or "", want[1] or ""), size


def test_a_think_tag_decoded_to_nothing_still_ends_the_reasoning():
    """A tokenizer that marks ``</think>`` special drops its text (skip_special_tokens): its id ends the reasoning."""
    from lineside.server.reasoning import ReasoningSplitter, ThinkTokens

    s = ReasoningSplitter(ThinkTokens(start_id=10, end_id=11, end_hidden=True), True)
    assert s.feed("abc", [5]) == ("abc", "")
    assert s.feed("", [11]) == ("", "")
    assert s.feed("xyz", [6]) == ("", "xyz")
    assert s.result() == ("abc", "xyz") and s.reasoning_tokens == 2


def test_a_hidden_think_tag_behind_held_text_ends_the_reasoning_after_it():
    """``held``: characters before the hidden ``</think>`` that a stop string holds back; they are reasoning when
    they come, however the later pieces split them."""
    from lineside.server.reasoning import ReasoningSplitter, ThinkTokens

    for pieces in (["4.\nxy"], ["4", ".\nx", "y"], ["4.", "\n", "xy"]):
        s = ReasoningSplitter(ThinkTokens(start_id=10, end_id=11, end_hidden=True), True)
        assert s.feed("abc ", [5]) == ("abc ", "")
        assert s.feed("", [7], held=1) == ("", "")  # "4" held: it is not the tag's
        assert s.feed("", [11], held=3) == ("", "")  # "4.\n" held when the tag comes
        got = [s.feed(p, [6]) for p in pieces]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == ("4.\n", "xy"), pieces
        assert s.result() == ("abc 4.\n", "xy") and s.reasoning_tokens == 3


def test_an_ordinary_think_tag_ends_the_reasoning_where_its_text_is():
    """An ordinary ``</think>`` whose text comes later (held back by a stop string) ends the reasoning there, not at
    its id; usage counts the tokens up to and including the tag's, however the pieces group them."""
    from lineside.server.reasoning import ReasoningSplitter, ThinkTokens

    s = ReasoningSplitter(ThinkTokens(start_id=10, end_id=11), True)
    assert s.feed("abc", [5]) == ("abc", "")
    assert s.feed("", [11]) == ("", "")  # the tag's text held back
    assert s.feed("</think>xyz", [6]) == ("", "xyz")
    assert s.result() == ("abc", "xyz") and s.reasoning_tokens == 2
    s = ReasoningSplitter(ThinkTokens(start_id=10, end_id=11), True)
    assert s.feed("ab</think>xy", [5, 11, 6]) == ("ab", "xy")  # one piece of several tokens (speculative)
    assert s.reasoning_tokens == 2


def test_the_tokenizer_says_whether_the_tag_is_hidden(r1_bundle):
    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer
    from lineside.server.reasoning import ThinkTokens

    tok = Tokenizer.from_bundle(open_bundle(r1_bundle))
    assert ThinkTokens.of(tok).end_hidden is False  # R1 releases the tags as ordinary added tokens

    class Special:  # a tokenizer that marks them special (skipped when decoding)
        def token_id(self, text):
            return {"<think>": 10, "</think>": 11}.get(text)

        def is_special(self, i):
            return i in (10, 11)

    assert ThinkTokens.of(Special()).end_hidden is True


@pytest.mark.parametrize("prompt, thinking", [
    ([1, 2, 10, 3], True),  # R1: "<｜Assistant｜><think>\n"
    ([1, 2, 10, 3, 11, 4], False),  # thinking switched off in the template ("<think>\n\n</think>\n\n")
    ([1, 2, 3], True),  # no tag at all: R1's reasoning comes first (vLLM's assumption)
    ([1, 11, 5, 10, 3], True),  # an earlier turn's tag, then a new <think>
    ([1, 10, 4, 11, 5, 2, 6, 7], True),  # an earlier turn's </think>, ended by EOS (2): the model opens its own
    ([1, 2, 6, 10, 11, 7], False),  # an EOS before the generation prompt's closed block
])
def test_where_the_output_starts(prompt, thinking):
    from lineside.server.reasoning import ThinkTokens

    assert ThinkTokens(start_id=10, end_id=11, turn_ends=frozenset({2})).thinking_after(prompt) is thinking


# ---- a </think> in an earlier, ended turn ----------------------------------------------------------------------
# Qwen3's template (on R1's markers here) keeps the reasoning of the assistant turns after the last user query (a
# tool loop's earlier steps) and opens no <think> in the generation prompt: the model writes it, and the prompt's last
# tag is that earlier turn's </think>, followed by the turn's end-of-sequence token.
KEPT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% if enable_thinking is defined and "
    "enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


class OpensItsOwnThink(ThinkingModel):
    """Plays Qwen3: after the prompt's last "<｜Assistant｜>", "<think>\\n" and then the script named in the last
    user turn, then EOS."""

    def logits(self, seq: list[int]) -> np.ndarray:
        turn = self.tok.encode(ASSISTANT, add_special=False)
        starts = [i for i in range(len(seq) - len(turn) + 1) if seq[i:i + len(turn)] == turn]
        x = np.full(self.vocab_size, -1e9, dtype=np.float32)
        if not starts:
            return x
        cut = starts[-1] + len(turn)
        last_user = self.tok.decode(seq[:cut], skip_special=False).rsplit(USER, 1)[-1]
        key = next((k for k in SCRIPTS if k in last_user), None)
        script = self.tok.encode("<think>\n" + SCRIPTS[key], add_special=False) if key else []
        i = len(seq) - cut
        x[script[i] if i < len(script) else self.eos] = 0.0
        return x


def test_a_think_block_of_an_ended_turn_does_not_close_the_new_ones(r1_bundle):
    """An earlier turn's ``</think>`` (its end-of-sequence token after it) says nothing about the turn being
    generated: the model opens its own reasoning, which is split off, and the grammar waits for its ``</think>``.
    A ``</think>`` the generation prompt itself holds (thinking switched off) still starts the output in the answer."""
    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(r1_bundle)
    be = OpensItsOwnThink(Tokenizer.from_bundle(b), num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2), reasoning_parser="deepseek_r1",
                        chat_template=KEPT_TEMPLATE) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        history = [{"role": "user", "content": "[think] What is 2+2?"},
                   {"role": "assistant", "content": "<think>\nAdd them.</think>It is 4."},
                   {"role": "user", "content": "[json] And as JSON?"}]
        m = _ask(srv, "", messages=history, response_format={"type": "json_object"}).choices[0].message
        assert (m.model_dump()["reasoning_content"], json.loads(m.content)) == ("\nThey want JSON.\n", {"city": "Lyon"})
        tok = srv.state.engine.tokenizer
        rendered = BOS + "".join(f"{USER}{m['content']}" if m["role"] == "user" else f"{ASSISTANT}{m['content']}{EOS}"
                                 for m in history)
        think = srv.state.think
        assert think.thinking_after(tok.encode(rendered + ASSISTANT, add_special=False))
        assert not think.thinking_after(tok.encode(rendered + ASSISTANT + "<think>\n\n</think>\n\n", add_special=False))


# ---- R1-Distill's other template releases -------------------------------------------------------------------------
# The first R1-Distill release (Jan 2025) opened no <think> in the generation prompt (the model wrote it); the same
# template otherwise, as above.
R1_FIRST_TEMPLATE = R1_TEMPLATE.replace("{{'<｜Assistant｜><think>\\n'}}", "{{'<｜Assistant｜>'}}")
# DeepSeek-R1-0528's template (R1-0528-Qwen3-8B's): the user turn itself ends "<｜Assistant｜>", no <think> opened
# (the model writes "<think>\n"), earlier answers cut at </think>, content alongside tool calls.
R1_0528_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true, "
    "is_last_user=false) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}"
    "{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}"
    "{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content'] + '<｜Assistant｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}"
    "{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{%- endif %}"
    "{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}{%- set ns.is_output_first = true %}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}"
    "{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + "
    "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and "
    "(message['tool_calls'] is not defined or message['tool_calls'] is none)%}{%- set ns.is_last_user = false -%}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + "
    "message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_last_user and not ns.is_tool %}"
    "{{'<｜Assistant｜>'}}{% endif %}")
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "[think] What is 2+2?"},
           {"role": "assistant", "content": "\n\nIt is 4.", "reasoning_content": "Add them.\n"},  # as clients echo it
           {"role": "user", "content": "[think] Again?"},
           {"role": "assistant", "content": "<think>\nStill 4.\n</think>\n\nFour."},  # the reasoning left in content
           {"role": "user", "content": "[json] And as JSON?"}]


@pytest.mark.parametrize("template", [R1_TEMPLATE, R1_FIRST_TEMPLATE, R1_0528_TEMPLATE], ids=["r1", "first", "0528"])
def test_each_r1_template_renders_as_transformers_and_splits(r1_bundle, template):
    """Each release's template: the server's prompt for a history with earlier reasoning (in ``reasoning_content`` or
    before ``</think>`` in the content) is transformers' apply_chat_template's, which drops that reasoning; ``auto``
    turns the parser on; the output (the model writing its own ``<think>`` where the template opens none) splits."""
    import httpx
    from transformers import PreTrainedTokenizerFast

    from lineside.bundle import open_bundle
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.tokenizer import Tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_file=str(r1_bundle / "tokenizer" / "tokenizer.json"), bos_token=BOS,
                                 eos_token=EOS)
    want = hf.apply_chat_template(HISTORY, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert "Add them" not in want and "Still 4" not in want and "Four." in want
    b = open_bundle(r1_bundle)
    tok = Tokenizer.from_bundle(b)
    opens = template.endswith("<think>\\n'}}{% endif %}")
    be = (ThinkingModel if opens else OpensItsOwnThink)(tok, num_slots=2, max_seq_len=CONTEXT)
    with running_server(LLMEngine(b, backend=be, num_slots=2), reasoning_parser="auto", chat_template=template) as srv:
        ids = httpx.post(srv.url + "/tokenize", json={"model": "r1", "messages": HISTORY}).json()["tokens"]
        assert tok.decode(ids, skip_special=False) == want
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        m = _ask(srv, "", messages=HISTORY).choices[0].message.model_dump()
        thought = "They want JSON.\n" if opens else "\nThey want JSON.\n"
        assert (m["reasoning_content"], json.loads(m["content"])) == (thought, {"city": "Lyon"})
        ((r, _, c, _),) = _streamed(srv, "", messages=HISTORY)
        assert (r, json.loads(c)) == (thought, {"city": "Lyon"})
