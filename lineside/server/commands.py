"""`lineside serve BUNDLE`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated

import typer

from lineside import cli_checks as checks

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def serve(
    bundle: Annotated[Path, typer.Argument(help="bundle directory (from `lineside build`)")],
    host: Annotated[str, typer.Option(help=(
        "address to bind: 127.0.0.1 or ::1 (alone or as [::1]) this machine only; 0.0.0.0 every IPv4 address, "
        ":: (or [::]) every address, IPv4 included on Linux; a name or address of this machine, no port or URL"))] = "127.0.0.1",
    port: Annotated[int, checks.number_option(low=1, high=65535, help="TCP port")] = 8000,
    *,
    backend: Annotated[str, typer.Option(help="auto | onnxruntime | tensorrt")] = "auto",
    api_key: Annotated[str | None, typer.Option(envvar="LINESIDE_API_KEY", show_envvar=True,
                                                help="require 'Authorization: Bearer KEY' on all but /health and "
                                                     "/health/ready (on the command line it shows in `ps`: prefer "
                                                     "the env var or --api-key-file)")] = None,
    api_key_file: Annotated[Path | None, typer.Option(help="read the API key from this file (one line)")] = None,
    allowed_hosts: Annotated[list[str] | None, typer.Option(
        help="Host names requests may use (repeat; '*' for any); default: loopback names when bound to loopback, "
             "any otherwise")] = None,
    allowed_origins: Annotated[list[str] | None, typer.Option(
        help="browser origins allowed to call (CORS, e.g. http://dash.local:3000; repeat); default: none")] = None,
    metrics_public: Annotated[bool, typer.Option(help="serve /metrics without the API key")] = False,
    openapi: Annotated[bool, typer.Option(help="serve the schema at /openapi.json (behind the key)")] = False,
    root_path: Annotated[str, typer.Option(
        help="path prefix a reverse proxy serves this under (e.g. /llm): requests may carry it (a proxy that keeps "
             "it) or not (one that strips it)")] = "",
    header_timeout: Annotated[float, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS, help="seconds a client has to send a request's headers")] = 10.0,
    body_timeout: Annotated[float, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS, help="longest pause, in seconds, inside a request body")] = 10.0,
    keep_alive_timeout: Annotated[float, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS, help="seconds an idle keep-alive connection stays")] = 5.0,
    send_timeout: Annotated[float, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS,
        help="seconds a client may take none of its answer (a stream it stopped reading) before its connection is "
             "reset and its generation cancelled")] = 60.0,
    max_connections_per_client: Annotated[int, checks.number_option(
        low=0, high=1_000_000, help="open connections one client address may hold (beyond: 429, closed; 0: no "
                                     "limit, e.g. behind a gateway that is one address)")] = 128,
    max_connections: Annotated[int, checks.number_option(
        low=1, high=1_000_000, help="open connections in all (beyond: 503, closed)")] = 1024,
    tokenizer_processes: Annotated[int, checks.number_option(
        low=0, high=256, help="worker processes that tokenize long prompts off the server's GIL (0: threads)")] = 1,
    request_timeout: Annotated[float | None, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS, help="seconds a request may take (default: none)")] = None,
    max_waiting: Annotated[int, checks.number_option(low=0, help="waiting-queue bound; beyond it requests get "
                                                                "429")] = 256,
    num_slots: Annotated[int, checks.number_option(low=1, high=4096, help="sequences decoded together (KV "
                                                                         "slots)")] = 8,
    drain_timeout: Annotated[float, checks.number_option(
        kind=float, low=0, high=checks.MAX_SECONDS,
        help="on SIGTERM, seconds to let in-flight requests finish")] = 30.0,
    max_failed_steps: Annotated[int, checks.number_option(
        low=1, high=1_000_000,
        help="model steps failing in a row (no step working between) after which a probe forward tests the backend; "
             "if it fails too, the engine is failed: /health and /health/ready answer 503 and the server exits 1 for "
             "its supervisor to restart it")] = 3,
    latency_log: Annotated[Path | None, typer.Option(help="append one JSON line per finished request")] = None,
    threads: Annotated[int | None, checks.number_option(low=1, high=checks.MAX_THREADS,
                                                        help="onnxruntime intra-op threads (default: one per physical core)")] = None,
    log_level: Annotated[str, typer.Option(help="critical | error | warning | info | debug")] = "info",
    access_log: Annotated[bool, typer.Option(help="log every HTTP request")] = False,
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="name clients send as 'model' (repeat for aliases; the first is the id shown); default: the "
             "bundle directory's name and the checkpoint's name")] = None,
    fallback: Annotated[Path | None, typer.Option(
        help="a second bundle (same tokenizer, e.g. a smaller model) loaded beside BUNDLE that takes traffic when "
             "the SLO guard degrades")] = None,
    slo_policy: Annotated[Path | None, typer.Option(
        help="SLO policy file (YAML or JSON): thresholds, recovery, pins; default with --fallback: TTFT P90 0.8 s / "
             "memory 85% → level 1, TTFT P90 1.5 s → level 2, recover after 300 s")] = None,
    speculative: Annotated[str | None, typer.Option(
        help="speculative decoding: ngram (prompt lookup) | layerskip:N (the bundle's first N layers, build "
             "--draft-layers N) | draft:BUNDLE (a smaller bundle, same tokenizer) | mtp (DeepSeek-V4's MTP module, "
             "built from a checkpoint with mtp.* tensors); a request's "
             "\"speculative\": false turns it off")] = None,
    spec_tokens: Annotated[int | None, checks.number_option(low=1, high=16, help="most tokens proposed per step (default 8)")] = None,
    lora_modules: Annotated[list[str] | None, typer.Option(
        help="LoRA adapter to serve as a model of its own: NAME=PEFT_DIR, or vLLM's JSON form '{\"name\": ..., "
             "\"path\": ...}' (repeat; the bundle's own adapters, "
             "`lineside lora list`, are served too)")] = None,
    max_loras: Annotated[int | None, checks.number_option(
        low=1, high=64, help="adapters held at once (slots; more are swapped in LRU; default: up to 4)")] = None,
    max_lora_rank: Annotated[int | None, checks.number_option(
        low=1, high=1024, help="largest adapter rank a slot holds (default: the bundle's --max-lora-rank)")] = None,
    allow_runtime_lora: Annotated[bool, typer.Option(
        "--allow-runtime-lora", help="serve POST /v1/load_lora_adapter {\"lora_name\", \"lora_path\"[, \"load_inplace\"]} "
             "and /v1/unload_lora_adapter {\"lora_name\"} (vLLM's, behind the API key) to add, replace and remove "
             "adapters while running, reading them only under --lora-dir; needs a bundle built with --max-lora-rank, "
             "and an API key unless bound to loopback (default: off, the routes are 404)")] = False,
    lora_dir: Annotated[list[str] | None, typer.Option(
        "--lora-dir", help="directory --allow-runtime-lora may load adapters from (repeat for more); a lora_path "
             "is relative to the first, or absolute under one, symlinks followed")] = None,
    session_ttl: Annotated[float, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS,
        help="seconds a prefill session's KV stays pinned after its last use (POST /v1/prefill)")] = 30.0,
    max_sessions: Annotated[int, checks.number_option(
        low=0, high=100000, help="prefill sessions held at once; beyond it POST /v1/prefill gets 429 and a keep_session "
                                       "completion's new session replaces the least recently used idle one (0: none). "
                                       "Each "
                                       "holding KV takes a slot: past --num-slots a new one ends the least recently "
                                       "used idle one")] = 64,
    max_stored_responses: Annotated[int, checks.number_option(
        low=0, high=1000000, help="/v1/responses kept in memory for previous_response_id and GET /v1/responses/ID "
                                  "(the least recently used dropped first; 0: none)")] = 256,
    max_stored_responses_mb: Annotated[int, checks.number_option(
        low=1, high=1000000, help="MiB of stored /v1/responses (their JSON: a long answer with top_logprobs is "
                                  "~1.3 KB a token) held at most, the least recently used dropped first; the newest "
                                  "is kept whatever its size")] = 64,
    max_cached_grammars: Annotated[int, checks.number_option(
        low=1, high=100000, help="compiled structured-output grammars kept for repeats (response_format, guided_*, "
                                 "required tools; the least recently used dropped first). Each costs "
                                 "~0.1-2 MB with a 49k vocabulary, more for bigger schemas")] = 64,  # structured.DEFAULT_CACHED_GRAMMARS
    chat_template: Annotated[str | None, typer.Option(
        help="render chats with this Jinja template instead of the bundle's: a file, the template text itself, or "
             "a shipped one (builtin:smollm2_tools: SmolLM2's own tool-calling prompt)")] = None,
    tool_call_parser: Annotated[str, typer.Option(
        help="how tool_choice auto reads the model's calls: auto (from the chat template) | hermes "
             "(<tool_call>{json}</tool_call>, or a JSON array in the tags) | llama3_json (bare JSON) | mistral "
             "([TOOL_CALLS] [{json}, ...] or [TOOL_CALLS]name[ARGS]{json}) | deepseek_v3 (DeepSeek V3 / R1's "
             "<｜tool▁call▁begin｜>function<｜tool▁sep｜>name + a json block) | deepseek_v31 "
             "(<｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}) | deepseek_v32 / deepseek_v4 (V3.2's / V4's DSML: "
             "<｜DSML｜function_calls> / <｜DSML｜tool_calls> blocks of <｜DSML｜invoke name=...>)")] = "auto",
    trust_request_chat_template: Annotated[bool, typer.Option(
        help="accept a request's own chat_template (vLLM's flag; refused with a 400 otherwise)")] = False,
    exclude_tools_when_tool_choice_none: Annotated[bool, typer.Option(
        help="leave a request's tools out of the prompt when its tool_choice is none (vLLM's flag; by default "
             "they are rendered, as OpenAI and vLLM do, and the answer is not read for calls)")] = False,
    reasoning_parser: Annotated[str, typer.Option(
        help="a reasoning model's thinking apart from its answer, as vLLM's parser: deepseek_r1 (text before "
             "</think> in message.reasoning_content, the answer alone in content; tool calls and structured outputs "
             "apply to the answer) | auto (deepseek_r1 when the chat template has <think> or </think>) | none")] = "none",
    generation_config: Annotated[str, typer.Option(
        help="auto: a request's missing temperature/top_p/top_k/min_p/repetition_penalty come from the model's "
             "generation_config.json (vLLM's default); vllm or none: OpenAI's defaults; a folder (or file): its "
             "generation_config.json")] = "auto",
) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (SSE streaming, /health, /metrics)."""
    from lineside.bundle import read_manifest, verify_files

    # Everything that can be wrong is checked before the socket opens and the model loads (one line each).
    backend = checks.choice(backend, "--backend", ("auto", "onnxruntime", "tensorrt"))
    log_level = checks.choice(log_level, "--log-level", LOG_LEVELS)
    from lineside.server.tool_calls import PARSERS

    tool_call_parser = checks.choice(tool_call_parser, "--tool-call-parser", tuple(PARSERS))
    from lineside.server.reasoning import PARSERS as REASONING_PARSERS

    reasoning_parser = checks.choice(reasoning_parser, "--reasoning-parser", REASONING_PARSERS)
    template_text = None
    if chat_template is not None:
        from lineside.runtime.chat_template import template_option

        template_text = template_option(chat_template)
    root_path = root_path_option(root_path)
    for opt, path in (("--api-key-file", api_key_file), ("--slo-policy", slo_policy)):
        if path is not None:
            checks.input_file(path, opt)
    if fallback is not None:
        checks.input_dir(fallback, "--fallback", "bundle directory")
    if latency_log is not None:
        checks.output_file(latency_log, "--latency-log", append=True)
    from lineside.runtime.speculative.config import parse_speculative

    spec = parse_speculative(speculative, spec_tokens)
    manifest = read_manifest(bundle)  # a wrong path fails here in one line
    # A missing or truncated file fails here, not after "serving on ..." (sizes only: the load checks the hashes).
    verify_files(Path(bundle), manifest, check_hash=False)
    from lineside.bundle import Bundle

    if reasoning_parser == "deepseek_r1":  # a model without the tags: one line now, not a failed load later
        from lineside.runtime.tokenizer import Tokenizer
        from lineside.server.reasoning import resolve

        resolve(reasoning_parser, Tokenizer.from_bundle(Bundle(path=Path(bundle), manifest=manifest)), None)
    from lineside.runtime.sampling_defaults import resolve_generation_config

    sampling_defaults = resolve_generation_config(generation_config,
                                                  Bundle(path=Path(bundle), manifest=manifest).tokenizer_dir)
    if backend == "tensorrt":
        from lineside.bundle import manifest_flavor

        manifest_flavor(Path(bundle), manifest, "trt")  # no trt graph: one line here, not a failed load later
    if spec is not None:
        from lineside.bundle import open_bundle
        from lineside.runtime.speculative.proposers import check_proposer

        check_proposer(spec, open_bundle(bundle, verify=False))
    lora = None
    if lora_modules or manifest.adapters or max_loras or max_lora_rank or allow_runtime_lora:
        from lineside.bundle import Bundle
        from lineside.runtime.adapters import parse_lora_modules, serving_config

        modules = parse_lora_modules(lora_modules or [])
        lora = serving_config(Bundle(path=Path(bundle), manifest=manifest), modules, max_loras=max_loras,
                              max_rank=max_lora_rank, runtime=allow_runtime_lora)
        if lora is not None:  # the base model wins a name both answer to: the adapter would be unreachable
            from lineside.bundle import default_model_names
            from lineside.errors import LinesideError

            base = ([n.strip() for n in served_model_name or [] if n.strip()]
                    or default_model_names(Path(bundle), manifest.to_json_dict()))
            clash = next((name for name in lora.adapters if name in base), None)
            if clash is not None:
                raise LinesideError(f"adapter name {clash!r} is also a name of the base model (it answers to "
                                    f"{', '.join(map(repr, base))}): requests for it would get the base model; give "
                                    "the adapter another name (or the base one with --served-model-name)")
    if backend == "tensorrt":  # TensorRT, cuda-python, a driver, a GPU and its engine (for the LoRA slots too)
        from lineside.bundle import Bundle
        from lineside.runtime.select import decide_backend

        decide_backend(Bundle(path=Path(bundle), manifest=manifest), "tensorrt", None if lora is None else lora.slots)
    if backend != "tensorrt":  # the onnxruntime arena lives in host memory: refuse what cannot fit
        need, what, fix = checks.decode_state_bytes(manifest, num_slots), f"the KV cache for --num-slots {num_slots}", \
            "lower --num-slots"
        if lora is not None and manifest.lora is not None:
            from lineside.bundle import Bundle
            from lineside.lora import LoraTarget
            from lineside.runtime.lora_stack import stack_bytes

            need += stack_bytes(Bundle(path=Path(bundle), manifest=manifest).config,
                                tuple(LoraTarget(t) for t in manifest.lora.targets), lora.slots)
            what += f" and {lora.slots.max_loras} adapter slots of rank {lora.slots.max_rank}"
            fix += ", --max-loras or --max-lora-rank"
        checks.fits_in_memory(need, what, fix)
    policy = None
    if slo_policy is not None:
        from lineside.server.slo.policy import load_policy

        policy = load_policy(slo_policy)
    if fallback is not None:
        from lineside.server.slo.fallback import available_bytes, check_fallback, check_fits

        check_fallback(bundle, fallback)
        check_fits(bundle, fallback, num_slots=num_slots, available=available_bytes())
        if spec is not None:  # the fallback engine runs --speculative too: its draft graph / module, checked here
            from lineside.bundle import open_bundle
            from lineside.errors import LinesideError
            from lineside.runtime.speculative.proposers import check_proposer

            try:
                check_proposer(spec, open_bundle(fallback, verify=False))
            except LinesideError as e:
                raise LinesideError(f"--fallback {fallback}: {e}") from None
    from lineside.server.browser_guard import check_browser_lists

    check_browser_lists([h for v in allowed_hosts or [] for h in v.split(",") if h.strip()],
                        [o for v in allowed_origins or [] for o in v.split(",") if o.strip()])
    from lineside.server.auth import resolve_api_key
    from lineside.server.lora_dirs import runtime_lora_dirs

    key = resolve_api_key(api_key, api_key_file)
    lora_dirs = runtime_lora_dirs(allow_runtime_lora, lora_dir or [], host, key)
    from lineside.server.bind import bind_socket

    sock = bind_socket(host, port)  # a busy/privileged port or a foreign host: one line, before the model loads
    try:
        logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
        if sampling_defaults.changed():  # as vLLM says it: a request's sampling differs from OpenAI's defaults
            logging.getLogger("lineside.server").info(
                "requests that leave them out sample with the model's generation_config.json: %s "
                "(--generation-config none for OpenAI's defaults)",
                ", ".join(f"{k}={v}" for k, v in sampling_defaults.changed().items()))
        # Cold start: the engine (checksums, onnxruntime session, tokenizer) builds on its own thread while this
        # one imports the web stack; onnxruntime and hashlib release the GIL, so on two cores the two overlap.
        engine_kwargs = dict(backend=backend, num_slots=num_slots, max_waiting=max_waiting, threads=threads,
                             session_ttl=session_ttl, max_sessions=max_sessions,
                             max_cached_grammars=max_cached_grammars, max_failed_steps=max_failed_steps)
        if spec is not None:
            engine_kwargs["speculative"] = spec
        engine = load_in_background(bundle, {**engine_kwargs, **({"lora": lora} if lora is not None else {})})
        from lineside.server.app import create_app
        from lineside.server.browser_guard import is_loopback
        from lineside.server.http_limits import HttpLimits

        hosts = [h for v in allowed_hosts or [] for h in v.split(",") if h.strip()]
        origins = [o for v in allowed_origins or [] for o in v.split(",") if o.strip()]
        if not is_loopback(host) and key is None:
            logging.getLogger("lineside.server").warning(
                "serving %s without an API key: anyone on the network can use it (--api-key-file FILE)", host)
        app = create_app(bundle, api_key=key, request_timeout=request_timeout, max_waiting=max_waiting,
                         latency_log=latency_log, drain_timeout=drain_timeout, backend=backend, num_slots=num_slots,
                         threads=threads,
                         served_model_names=[name.strip() for name in served_model_name or [] if name.strip()],
                         bind_host=host, allowed_hosts=hosts, allowed_origins=origins, metrics_public=metrics_public,
                         openapi=openapi, tokenizer_processes=tokenizer_processes, fallback=fallback,
                         slo_policy=policy, engine_future=engine, speculative=spec, session_ttl=session_ttl,
                         max_sessions=max_sessions, lora=lora, chat_template=template_text,
                         trust_request_chat_template=trust_request_chat_template, tool_call_parser=tool_call_parser,
                         exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
                         max_stored_responses=max_stored_responses,
                         max_stored_responses_mb=max_stored_responses_mb, sampling_defaults=sampling_defaults,
                         reasoning_parser=reasoning_parser, root_path=root_path,
                         allow_runtime_lora=allow_runtime_lora, lora_dirs=lora_dirs.given,
                         max_cached_grammars=max_cached_grammars,
                         max_failed_steps=max_failed_steps)
        limits = HttpLimits(header_timeout=header_timeout, body_timeout=body_timeout,
                            keep_alive_timeout=keep_alive_timeout, send_timeout=send_timeout,
                            max_connections_per_client=max_connections_per_client, max_connections=max_connections)
    except BaseException:
        sock.close()
        raise
    from lineside.server.serve import run  # uvicorn: imported while the engine loads

    run(app, sock, log_level=log_level, access_log=access_log, limits=limits)


def root_path_option(value: str) -> str:
    """--root-path as the router compares it: '' or '/a/b' (a trailing '/' dropped); a value no request path can
    begin with (no leading '/', a query, a fragment, whitespace) is one line here, not every request a 404 later."""
    from lineside.errors import LinesideError

    path = value.strip()
    if not path:
        return ""
    if not path.startswith("/"):
        raise LinesideError(f"--root-path {value!r}: the prefix must begin with '/' (e.g. /{path.lstrip('/')})")
    if any(ch in path for ch in "?#%") or any(ch.isspace() or not ch.isprintable() for ch in path):
        raise LinesideError(f"--root-path {value!r}: give the URL path prefix alone (e.g. /llm), without a query, "
                            "fragment, percent-escapes or spaces")
    return path.rstrip("/")


def load_in_background(bundle: Path, engine_kwargs: dict) -> Future:
    """Start building (and warming up) the bundle's LLMEngine on a daemon thread (it must not keep a failed
    server alive); the future carries the engine or the error the loader reports."""
    # Imported here, on the calling thread, so the loader thread and the web-stack imports never import
    # the same module at the same time (Python's per-module import locks could hand one a half-made module).
    import lineside.runtime.generate  # noqa: F401 - what LLMEngine imports lazily, same reason
    import lineside.runtime.onnxruntime_backend  # noqa: F401
    import lineside.runtime.select  # noqa: F401
    import lineside.runtime.tensorrt.key  # noqa: F401
    from lineside.runtime.engine import LLMEngine, in_thread

    def build() -> LLMEngine:
        engine = LLMEngine(bundle, **engine_kwargs)
        engine.warm_up()  # here, while the main thread still imports the web stack: off the path to ready
        return engine

    return in_thread(build, name="lineside-load")  # an error is handed to the server's loader, which reports it


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
