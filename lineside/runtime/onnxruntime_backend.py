"""onnxruntime backend: runs a bundle's ``cpu`` (or ``trt``) graph and owns its state arena.

The arena holds every state tensor for ``num_slots`` sequences. For the ``cpu`` flavor the KV
cache is updated in place: past and present are bound to the same memory with IOBinding, so a
decode step copies no cache. ``append`` states (the ``trt`` flavor) get the past sliced out and
the new entries written back; ``replace`` states are swapped whole.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

import numpy as np

from lineside.bundle import Bundle, FlavorEntry
from lineside.config import DENSE_FAMILIES
from lineside.errors import LinesideError
from lineside.graph_io import PACKED_INT4, StateTensor, StateUpdate, resolve_shape
from lineside.lora import LORA_SLOTS_INPUT, LoraAdapter, LoraTarget
from lineside.runtime import rows_kernel
from lineside.runtime.backend import StepBatch
from lineside.runtime.cpu_features import default_threads, host_int8_gemm_exact
from lineside.runtime.graph_context import check_rope_positions
from lineside.runtime.huge_pages import advise_huge_pages
from lineside.runtime.kv_bytes import KvArenaBytes, arena_bytes, kv_label
from lineside.runtime.lora_stack import LoraSlotsConfig, LoraStack
from lineside.runtime.ort_cache import GraphRewrite, open_session

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
       "uint8": np.uint8,  # the trt flavor's int8 KV cache (grid + 128)
       PACKED_INT4: np.uint8}  # its int4 KV cache: two 4-bit grid values per byte


log = logging.getLogger("lineside.runtime")

SPIN_ENV = "LINESIDE_ORT_SPIN"
PREFILL_ENV = "LINESIDE_PREFILL_GRAPH"  # 0: prompt chunks on the 4-bit graph too (an A/B switch for benchmarks)
# A row of several new tokens with a logit wanted at fewer of them (a prompt chunk; a verification wants one at each)
# runs on the bundle's int8 prefill graph when it has one (build/graph/prefill.py). Every chunk of two tokens or more,
# not only long ones: a token's cache entry must not depend on how the scheduler cut its prompt (it keeps 1-token
# steps for decode, scheduler.py), or batching and prefix reuse would change a greedy answer. At 8 tokens the two
# graphs cost the same; at 512 the int8 one is 2x faster (SmolLM2, 2 threads, benchmarks/prefill_graph.py).
PREFILL_MIN_TOKENS = 2
# "int8": every step of the base model (decode too) on the int8 prefill graph, and the 4-bit graph not loaded. A
# throughput mode: MatMulNBits' cost grows almost linearly with decode rows on x86 (each pair of rows re-reads and
# re-scales every 4-bit block), the int8 product (MatMulIntegerToFloat) far less, so 8 streams gain ~20% and one
# stream loses ~10% (twice the weight bytes); outputs stay identical to sequential runs in the same mode (the graph
# quantizes activations per row). `python benchmarks/decode_rows.py` measures both.
DECODE_GRAPH_ENV = "LINESIDE_DECODE_GRAPH"
# The oldest onnxruntime that runs every graph a build writes: 1.20 and 1.21 have no 8-bit MatMulNBits (a w4a16
# bundle's LM head, every w8a16 linear). Checked per version, graph by graph, against 1.32's logits: README
# "Requirements". pyproject.toml asks for the same.
MIN_ONNXRUNTIME = (1, 22)
# Steps of one row with up to this many new tokens (a verification: 1 + at most 16 drafts) reuse a cached binding.
FAST_VERIFY_TOKENS = 17


def no_int8_graph_hint(architecture: str, scheme: str | None, flavor: str) -> str:
    """What would give a bundle an int8 graph: `build --prefill-graph` refuses other models, quants and flavors,
    so the refusal must not send a DeepSeek-V4, fp32 or trt-only bundle's user there."""
    if architecture not in DENSE_FAMILIES:
        return f"it is built for Llama and Qwen2 models only, not {architecture}"
    if scheme not in ("w4a16", "w8a16"):
        return f"it is built for w4a16 and w8a16 bundles only, not {scheme}"
    if flavor != "cpu":
        return f"it is the cpu flavor's, not the {flavor} flavor's: rebuild with --flavors cpu"
    return "rebuild it with --prefill-graph"


def decode_graph_int8(entry: FlavorEntry, *, lora: bool, hint: str = "rebuild it with --prefill-graph") -> bool:
    """Whether ``DECODE_GRAPH_ENV`` asks every step on the int8 graph; refused in one line where it cannot be had
    (``hint``: what would give this bundle an int8 graph, no_int8_graph_hint)."""
    value = os.environ.get(DECODE_GRAPH_ENV, "").strip().lower()
    if value in ("", "4bit", "default"):
        return False
    if value != "int8":
        raise LinesideError(f"{DECODE_GRAPH_ENV}={value!r} is not a decode graph: use int8, or 4bit (the default)")
    if entry.prefill_graph is None:
        raise LinesideError(f"{DECODE_GRAPH_ENV}=int8: this bundle has no int8 graph ({hint}); unset "
                            f"{DECODE_GRAPH_ENV}")
    if lora:
        raise LinesideError(f"{DECODE_GRAPH_ENV}=int8 runs the base model only (the LoRA graph has no int8 variant): "
                            f"serve without --max-loras, or unset {DECODE_GRAPH_ENV}")
    if os.environ.get(PREFILL_ENV, "1") == "0":
        raise LinesideError(f"{DECODE_GRAPH_ENV}=int8 and {PREFILL_ENV}=0 ask for opposite graphs: unset one")
    if not host_int8_gemm_exact():
        raise LinesideError(f"{DECODE_GRAPH_ENV}=int8: onnxruntime's int8 product saturates on this CPU (x86 without "
                            f"VNNI); unset {DECODE_GRAPH_ENV}")
    return True


def check_onnxruntime_version(version: str) -> None:
    """Refuse an onnxruntime older than MIN_ONNXRUNTIME in one line, before it fails on a graph with a C++
    assertion that names no version (a Jetson's NVIDIA wheel, an environment pinned long ago)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is not None and (int(m[1]), int(m[2])) < MIN_ONNXRUNTIME:
        need = ".".join(map(str, MIN_ONNXRUNTIME))
        raise LinesideError(f"onnxruntime {version} is too old: lineside's graphs need {need} or newer (8-bit "
                            f"MatMulNBits); pip install -U onnxruntime")


class StepTap(Protocol):
    """Sees what the backend does to its slots: the named graph outputs of each run (for the rows' new positions)
    and the slot copies and resets. The MTP proposer keeps the target's last-layer streams this way."""

    outputs: tuple[str, ...]

    def on_forward(self, batch: StepBatch, values: dict[str, np.ndarray]) -> None:
        ...

    def on_copy(self, src: int, dst: int, length: int) -> None:
        ...

    def on_reset(self, slot: int) -> None:
        ...


class OnnxRuntimeBackend:
    name = "onnxruntime"
    # The in-place cache binds a range of slots as a view; other slot lists gather and scatter whole slots.
    needs_contiguous_slots = True

    def __init__(self, bundle: Bundle, num_slots: int = 1, flavor: str | None = None, threads: int | None = None,
                 max_seq_len: int | None = None, accuracy_level: int | None = None, spin: bool | None = None,
                 entry: FlavorEntry | None = None, shared: dict[str, np.ndarray] | None = None,
                 lora: LoraSlotsConfig | None = None, draft_model: bool = False):
        """``entry``: another graph of the bundle than the flavor's own (a layerskip draft graph); ``shared``:
        state arrays, by input name, to use instead of allocating them (the target's KV for the draft's layers);
        ``lora``: the adapter slots to serve (the bundle's LoRA graph runs instead of the base graph);
        ``draft_model``: a draft:BUNDLE model's backend, on its default graphs (DECODE_GRAPH_ENV is the served
        model's: a draft's one-row steps are faster on the 4-bit graph, and it need not have an int8 one)."""
        import onnxruntime as ort

        check_onnxruntime_version(ort.__version__)
        flavor = flavor or ("cpu" if "cpu" in bundle.flavors else next(iter(bundle.flavors), "cpu"))  # none: refused
        # the served model's own graph (not a draft graph nor a draft model's: DECODE_GRAPH_ENV is for it only)
        own_graph = entry is None and not draft_model
        entry = entry or bundle.flavor(flavor)
        self.flavor = flavor
        if accuracy_level is None and flavor == "trt":
            # The trt graph's fp16 DequantizeLinear+MatMul pairs are fused by onnxruntime into MatMulNBits at its
            # default accuracy level 4, which on CPU returns all-zero logits for them (onnxruntime 1.32, SmolLM2
            # W4A16): a bundle with only the trt flavor served on onnxruntime answered nothing. Level 0 is exact.
            accuracy_level = 0
        check_state_dtypes(entry.state)  # before loading a graph whose cache it could not hold
        self.accuracy_level = accuracy_level
        graph = entry.graph
        # A LoRA graph (built with --max-lora-rank) when adapters are served: the base graph otherwise, as fast
        # as it always was. The stack of adapter slots is allocated once and bound by pointer (packed: its live
        # width is what is loaded); a step with no adapter row binds it at width 0, so its deltas read nothing
        # (a second session on the base graph would be a second copy of every prepacked weight: +120 MB RSS on
        # SmolLM2, measured with benchmarks/multi_lora.py).
        self.lora: LoraStack | None = None
        if lora is not None:
            graph = lora_graph_of(bundle, flavor)
            assert bundle.manifest.lora is not None
            self.lora = LoraStack(bundle.config, tuple(LoraTarget(t) for t in bundle.manifest.lora.targets), lora)
        self.num_slots = int(num_slots)
        self.max_seq_len = int(min(max_seq_len or bundle.max_seq_len, bundle.max_seq_len))
        # a max_seq_len raised by hand past the graph's rotary tables: refused here, not by a long request's step
        check_rope_positions(bundle.file(graph), graph, self.max_seq_len, bundle.config.context_limit)
        self.vocab_size = bundle.config.vocab_size
        self.quantization = bundle.manifest.quantization  # names a quantized KV dtype (kv_arena_bytes)
        n_threads = int(threads or default_threads())
        config = {} if accuracy_level is None else {"session.qdq_matmulnbits_accuracy_level": str(accuracy_level)}
        # Spinning intra-op threads busy-wait between kernels: on a dedicated machine (a Jetson, a line PC)
        # that is what makes decode fast — the demo bundle served 84.7 vs 60.8 tok/s with it on a quiet 2-core
        # machine (benchmarks/served_side_by_side.py --lineside-env spin:LINESIDE_ORT_SPIN=1). On a machine
        # shared with other work a descheduled spinner stalls every kernel after it (2-3x slower measured
        # under load): LINESIDE_ORT_SPIN=0 turns it off there.
        spin_env = os.environ.get(SPIN_ENV, "1") if spin is None else ("1" if spin else "0")
        # "keep": threads also spin between runs (the behaviour before force_spinning_stop, for comparison)
        spin_flag, stop_flag = ("1", "0") if spin_env == "keep" else (spin_env, spin_env)
        self.spinning = spin_flag == "1"

        def options() -> Any:
            so = ort.SessionOptions()
            so.intra_op_num_threads = n_threads
            so.inter_op_num_threads = 1
            for k, v in config.items():
                so.add_session_config_entry(k, v)
            so.add_session_config_entry("session.intra_op.allow_spinning", spin_flag)  # not a graph setting
            # ... and only within a run: each session has a pool of its own, and one still spinning after its run
            # took a core from the other (the prefill graph's after a prompt chunk, the decode graph's after a step):
            # the first decode steps after a 64-token chunk cost 10.5 ms instead of 6.6, the chunk after decode
            # steps 63-70 ms instead of 38; steady decode the same (6.2-6.5 ms a step either way).
            so.add_session_config_entry("session.force_spinning_stop", stop_flag)
            return so

        # 4-bit MatMulNBits on the rows kernel where it is built (rows_kernel.py): several rows cost little more
        # than one. Part of the graph cache's key, so a cache made without it is not loaded with it, or back.
        rows_library = rows_kernel.library()
        rewrite, cache_settings = None, dict(config)
        kernel_isa = rows_kernel.isa(rows_library) if rows_library is not None else "none"
        if rows_library is not None and kernel_isa != "none":  # AVX2 takes the 4-bit nodes only
            rewrite = GraphRewrite(rows_library, partial(rows_kernel.rewritten, bits=rows_kernel.bits_for(kernel_isa)))
            cache_settings["rows_kernel"] = f"{rows_kernel.digest()}-{rows_kernel.RULES}-{kernel_isa}"

        def load(rel: str) -> tuple[Any, str]:
            sha = _graph_files_sha(bundle, rel)
            if rewrite is not None:
                try:
                    return open_session(ort, bundle.file(rel), sha, options, cache_settings,
                                        providers=["CPUExecutionProvider"], rewrite=rewrite)
                except Exception as e:  # noqa: BLE001 - the graph as it is decides whether it is a bad graph
                    log.warning("the rows kernel could not run %s (%s); onnxruntime's own kernel runs it (%s=0 "
                                "skips the kernel)", rel, str(e).splitlines()[0] if str(e) else type(e).__name__,
                                rows_kernel.ENV)
            try:
                # The optimized graph is cached beside the bundle's (ort_cache): later starts skip the optimizer.
                return open_session(ort, bundle.file(rel), sha, options, config, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime raises its own exception types for bad graphs
                raise LinesideError(f"onnxruntime could not load {rel}: {str(e).splitlines()[0]}") from None

        # Prompt chunks on the int8 variant (a second session over the same data file): the base model's, so with
        # adapter slots the base requests' chunks take it and the adapters' run on the LoRA graph (it has no int8
        # variant); not for a draft graph (its record names none), nor on a CPU whose int8 product saturates
        # (cpu_features.py). Opened beside the main session on a thread of its own (onnxruntime packs weights
        # without the GIL): 0.1-0.2 s less to ready.
        prefill = entry.prefill_graph if os.environ.get(PREFILL_ENV, "1") != "0" else None
        scheme = (self.quantization or {}).get("scheme")
        if own_graph and decode_graph_int8(entry, lora=lora is not None,
                                           hint=no_int8_graph_hint(bundle.architecture, scheme, flavor)):
            graph, prefill = str(entry.prefill_graph), None  # the main session is the int8 graph: nothing beside it
            log.info("every step runs on the bundle's int8 graph (%s=int8): throughput over one stream's speed",
                     DECODE_GRAPH_ENV)

        def load_prefill(rel: str) -> Any:
            if not host_int8_gemm_exact():  # one run of the int8 product (~13 ms, cached per process)
                log.info("prompts run on the 4-bit graph: onnxruntime's int8 product saturates on this CPU (x86 "
                         "without VNNI), so the bundle's int8 prefill graph is left unused")
                return None
            try:
                return load(rel)[0]
            except LinesideError as e:  # an onnxruntime that runs the main graph but not this one: only a faster
                # way to the same prompts. Bundles built before the prefill emitter stopped broadcasting against a
                # shape older inference gets wrong load it on onnxruntime >= 1.31 only (Python 3.10's newest is 1.23)
                log.warning("prompts run on the 4-bit graph: %s (onnxruntime %s); rebuild the bundle with this "
                            "lineside (or upgrade onnxruntime) to use the int8 prefill graph", e, ort.__version__)
                return None

        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(load_prefill, prefill) if prefill else None
            self.session, self.session_source = load(graph)
            self.prefill_session: Any = pending.result() if pending is not None else None
        advise_huge_pages()  # the weights it just packed: 2 MB pages (huge_pages.py)
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.states = list(entry.state)
        dims = {"batch": self.num_slots, "max_seq": self.max_seq_len, "past_seq": self.max_seq_len}
        declared = {i.name: (i.shape, i.type) for i in self.session.get_inputs()}
        self.arena: dict[str, np.ndarray] = {}
        for st in self.states:
            shape, dtype = _state_shape(st, declared.get(st.input), dims, graph), _NP[st.dtype]
            have = (shared or {}).get(st.input)
            if have is not None and (have.shape != shape or have.dtype != dtype):
                raise LinesideError(f"state {st.input} of {entry.graph} is {shape} {np.dtype(dtype)}, the graph it "
                                    f"shares it with holds {have.shape} {have.dtype}; rebuild the bundle")
            self.arena[st.input] = have if have is not None else arena_zeros(shape, dtype)
        self.uses_gqa = "seqlens_k" in self.input_names
        # The cached decode binding covers graphs whose only state is the in-place cache (the cpu flavor).
        self._decode_ready = self.uses_gqa and all(st.update == StateUpdate.INPLACE for st in self.states) and \
            self.input_names <= {"input_ids", "logits_positions", "seqlens_k", "total_sequence_length",
                                 *(st.input for st in self.states), *self._lora_inputs()}
        self._fast: dict[tuple[int, int, int, int, bool], tuple[Any, ...]] = {}
        self._fast_verify: dict[tuple[int, int, int, int, bool], tuple[Any, ...]] = {}
        self._fast_version = 0  # the LoRA stack's layout the cached bindings point at
        # Graphs whose states all go in by value (the trt flavor): outputs bound once per step shape (_step_by_value).
        self._by_value_ready = self.lora is None and all(st.update != StateUpdate.INPLACE for st in self.states)
        self._by_value: dict[tuple[int, int, int], tuple[Any, dict[str, np.ndarray]]] = {}  # (rows, new, logits)
        # Per state, worked out once: its name, arena array and, for an append state, the index of the axes before
        # its sequence axis (a by-value step indexes with it: the past it binds, the new entries it stores).
        self._value_states = [(st.input, st.output, self.arena[st.input],
                               (slice(None),) * (st.seq_axis - 1) if st.update == StateUpdate.APPEND else None)
                              for st in self.states]
        # Speculative decoding (engine.py): GroupQueryAttention runs each multi-token row alone, so verification
        # pays only for a lone decoding row. On CPU a step's cost grows with its tokens: a step with k drafts
        # costs about 1 + 0.25·k one-token steps (SmolLM2 W4A16, 2 threads, level 4: 2 tokens 1.2x, 5 tokens
        # 1.8-2.0x, 9 tokens 2.5-3x; `python benchmarks/speculative.py --step-cost` fits the line), so the
        # adaptive rule weighs each drafted token (speculative/adaptive.py) rather than a flat bar.
        # Whole-state tensors (DeepSeek-V4) take no per-row new length: rows of different lengths run apart.
        self._whole_state = any(st.update == StateUpdate.REPLACE for st in self.states)
        self.spec_max_rows = 1 if self.uses_gqa or self._whole_state else None
        self.verify_cost, self.verify_token_cost = 1.05, 0.21
        self.taps: list[StepTap] = []

    @classmethod
    def draft_of(cls, target: OnnxRuntimeBackend, bundle: Bundle, draft: dict[str, Any],
                 threads: int | None = None) -> OnnxRuntimeBackend:
        """The bundle's layerskip draft graph (its first N layers, the same weight data) on ``target``'s KV:
        those layers' cache entries are the target's for every position the target has computed."""
        entry = FlavorEntry.from_record(draft, "layerskip draft graph")
        return cls(bundle, num_slots=target.num_slots, flavor=target.flavor, threads=threads,
                   max_seq_len=target.max_seq_len, spin=target.spinning, entry=entry, shared=target.arena,
                   accuracy_level=target.accuracy_level)

    def add_tap(self, tap: StepTap) -> None:
        """Report ``tap.outputs`` of every run (and every slot copy and reset) to ``tap`` from now on."""
        have = {o.name for o in self.session.get_outputs()}
        missing = [n for n in tap.outputs if n not in have]
        if missing:
            raise LinesideError(f"the {self.flavor} graph has no output {missing[0]!r}; rebuild the bundle")
        self.taps.append(tap)
        self._decode_ready = False  # the cached decode binding binds logits and the cache only

    def forward_outputs(self, batch: StepBatch, names: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One run (no splitting of rows: give rows of one length) returning the logits and the named outputs."""
        self._check_length(batch)
        return self._run(batch, names)

    def _check_length(self, batch: StepBatch) -> None:
        """Refuse a step that would run any row past the bundle's max_seq_len (one line, before any run)."""
        end = int((batch.past_lengths + batch.new_lengths).max())
        if end > self.max_seq_len:
            raise LinesideError(f"sequence of {end} tokens exceeds the bundle's max_seq_len {self.max_seq_len}")

    # ---- LoRA slots (LoraBackend) ------------------------------------------------------
    @property
    def max_loras(self) -> int:
        return 0 if self.lora is None else self.lora.slots.max_loras

    @property
    def max_lora_rank(self) -> int:
        return 0 if self.lora is None else self.lora.slots.max_rank

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        if self.lora is None:
            raise LinesideError("this backend runs the base graph; start it with adapter slots (--max-loras)")
        self.lora.load(slot, adapter)  # repacked in place: the cached bindings are rebuilt at the new width

    def unload_adapter(self, slot: int) -> None:
        if self.lora is not None:
            self.lora.unload(slot)

    def _lora_inputs(self) -> list[str]:
        return [] if self.lora is None else [LORA_SLOTS_INPUT, *self.lora.arrays]

    def _uses_lora(self, batch: StepBatch) -> bool:
        """Whether this step reads the adapter stack: some row names an adapter slot and some adapter is loaded."""
        return self.lora is not None and self.lora.width > 0 and bool(batch.adapter_rows().any())

    def _bind_lora(self, io: Any, rows: np.ndarray, lora: bool) -> None:
        """The stack (by pointer: no copy per step) and the rows' adapter slots; ``lora`` false: the stack at
        width 0 (every delta an empty product)."""
        if self.lora is None:
            return
        self._bind(io, LORA_SLOTS_INPUT, rows, output=False)
        for name, arr in (self.lora.arrays if lora else self.lora.empty).items():
            self._bind(io, name, arr, output=False)

    # ---- Backend interface ------------------------------------------------------------
    def kv_arena_bytes(self) -> KvArenaBytes:
        """The state arena's real allocation (every state tensor, all slots), for the /metrics KV gauges."""
        return arena_bytes(kv_label(self.quantization, (a.dtype for a in self.arena.values())),
                           (a.nbytes for a in self.arena.values()), num_slots=self.num_slots,
                           max_seq_len=self.max_seq_len,
                           sequence_bytes=sum(self.arena[st.input].nbytes for st in self.states
                                              if st.update == StateUpdate.PREFIX))

    def forward(self, batch: StepBatch) -> np.ndarray:
        b, s = batch.input_ids.shape
        self._check_length(batch)
        if b > 1 and s > 1 and (self.uses_gqa or (self._whole_state and len(set(batch.new_lengths.tolist())) > 1)):
            # GroupQueryAttention takes one new length per step for the whole batch: rows with several new tokens
            # (prefill, speculative verification) run one by one; the 1-token rows beside them run together,
            # in runs of adjacent slots, so they keep the batched decode path.
            return self._split(batch)
        chunk = batch.prompt or batch.logits_positions.shape[1] < s  # a prompt's: flagged, or logits at fewer
        if self.prefill_session is not None and b == 1 and s >= PREFILL_MIN_TOKENS and chunk \
                and not batch.adapter_rows().any():
            # a base model's prompt chunk, scored at every position or not (not a verification, not an adapter's: the
            # LoRA graph has no int8 variant)
            return self._run(batch, session=self.prefill_session)[0]
        verify = b == 1 and s <= FAST_VERIFY_TOKENS and not chunk  # a verification: logits at each new token
        slots = list(batch.slots)
        adjacent = slots == list(range(slots[0], slots[0] + b))
        if self._decode_ready and (s == 1 or verify) and adjacent:
            return self._decode_fast(batch)
        if self._by_value_ready and adjacent and not self.taps and s <= FAST_VERIFY_TOKENS:
            return self._step_by_value(batch)  # prefill chunks keep the generic path: no buffers per chunk size
        return self._run(batch)[0]

    def _split(self, batch: StepBatch) -> np.ndarray:
        b, k = batch.logits_positions.shape
        out = np.empty((b, k, self.vocab_size), dtype=np.float32)
        runs: list[list[int]] = []
        for r in range(b):
            single = int(batch.new_lengths[r]) == 1
            if single and runs and int(batch.new_lengths[runs[-1][-1]]) == 1 \
                    and batch.slots[runs[-1][-1]] + 1 == batch.slots[r]:
                runs[-1].append(r)
            else:
                runs.append([r])
        for rows in runs:
            part = StepBatch(slots=[batch.slots[r] for r in rows],
                             input_ids=np.ascontiguousarray(batch.input_ids[rows][:, :int(batch.new_lengths[rows[0]])]),
                             past_lengths=batch.past_lengths[rows], new_lengths=batch.new_lengths[rows],
                             logits_positions=np.ascontiguousarray(batch.logits_positions[rows]),
                             adapters=batch.adapter_rows()[rows])
            out[rows] = self.forward(part)
        return out

    def _decode_fast(self, batch: StepBatch) -> np.ndarray:
        """Decode step with a cached IOBinding: the cache and the small inputs are bound once per
        (first slot, batch, new tokens, n_logits, adapters used); a step only writes a few integers and runs. A lone
        row's verification step (a few new tokens, speculative decoding) takes it too: binding the whole cache anew
        cost it about a tenth of a decode step."""
        b, s, k = len(batch.slots), batch.input_ids.shape[1], batch.logits_positions.shape[1]
        lora = self._uses_lora(batch)
        key = (batch.slots[0], b, s, k, lora)
        if self.lora is not None and self._fast_version != self.lora.version:
            self._fast.clear()  # an adapter came or went: the stack's views changed width
            self._fast_verify.clear()
            self._fast_version = self.lora.version
        cache = self._fast if s == 1 else self._fast_verify  # apart: each verify binding holds s rows of logits
        fast = cache.get(key)
        if fast is None:
            if len(cache) >= (32 if s == 1 else 16):
                cache.clear()
            fast = cache[key] = self._bind_decode(batch.slots[0], b, k, lora, s)
        io, ids, pos, seqlens, total, logits, adapters = fast
        adapters[:] = batch.adapter_rows()
        ids[:] = batch.input_ids
        pos[:] = batch.logits_positions
        ends = batch.past_lengths + batch.new_lengths
        seqlens[:] = ends - 1
        total[...] = int(ends.max())
        self.session.run_with_iobinding(io)
        return logits.copy()

    def _bind_decode(self, first: int, b: int, k: int, lora: bool, s: int = 1) -> tuple[Any, ...]:
        io = self.session.io_binding()
        self._bound_outputs, self._keep_alive = [], []
        ids = np.zeros((b, s), np.int64)
        pos = np.zeros((b, k), np.int64)
        seqlens = np.zeros((b,), np.int32)
        total = np.zeros((), np.int32)
        logits = np.zeros((b, k, self.vocab_size), np.float32)
        adapters = np.zeros((b,), np.int64)
        self._bind_lora(io, adapters, lora)
        for name, arr in (("input_ids", ids), ("logits_positions", pos), ("seqlens_k", seqlens),
                          ("total_sequence_length", total)):
            self._bind(io, name, arr, output=False)
        for st in self.states:
            view = self.arena[st.input][first:first + b]
            self._bind(io, st.input, view, output=False)
            self._bind(io, st.output, view, output=True)
        self._bind(io, "logits", logits, output=True)
        # The arena outlives the binding; the small arrays live in the returned tuple.
        self._keep_alive = []
        return io, ids, pos, seqlens, total, logits, adapters

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for s in self.states:
            a = self.arena[s.input]
            if s.update.fixed:
                a[dst] = a[src]
            else:
                idx = [slice(None)] * a.ndim
                idx[0], idx[s.seq_axis] = dst, slice(0, length)
                src_idx = list(idx)
                src_idx[0] = src
                a[tuple(idx)] = a[tuple(src_idx)]
        for tap in self.taps:
            tap.on_copy(src, dst, length)

    def save_rows(self, slots: list[int]) -> dict[int, dict[str, np.ndarray]]:
        """Copies of ``slots``' whole-state tensors (mode replace): where a verification step started, for
        ``restore_rows`` when the row keeps fewer tokens than the step fed."""
        return {slot: {st.input: self.arena[st.input][slot].copy() for st in self.states
                       if st.update == StateUpdate.REPLACE} for slot in slots}

    def restore_rows(self, saved: dict[int, dict[str, np.ndarray]], slot: int) -> None:
        for name, value in saved[slot].items():
            self.arena[name][slot] = value

    def reset_slot(self, slot: int) -> None:
        for s in self.states:
            if s.update.fixed:
                self.arena[s.input][slot] = 0
        for tap in self.taps:
            tap.on_reset(slot)

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]
        self.prefill_session = None

    # ---- one step -----------------------------------------------------------------------
    def _run(self, batch: StepBatch, want: tuple[str, ...] = (), session: Any = None
             ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Logits and the outputs named in ``want``; the taps get theirs. ``session``: another graph's (prefill)."""
        session = session or self.session
        b, s = batch.input_ids.shape
        slots = list(batch.slots)
        contiguous = slots == list(range(slots[0], slots[0] + b))
        past = batch.past_lengths.astype(np.int64)
        p_max = int(past.max()) if b else 0
        lora = self._uses_lora(batch)
        io = session.io_binding()
        self._bound_outputs: list[str] = []
        self._keep_alive: list[np.ndarray] = []
        for name, arr in self._feeds(batch, past, p_max).items():
            io.bind_cpu_input(name, arr)
        if session is self.session:  # the prefill graph is the base model's: no adapter inputs
            self._bind_lora(io, np.ascontiguousarray(batch.adapter_rows()), lora)
        views: dict[str, np.ndarray] = {}
        rows = slice(slots[0], slots[0] + b) if contiguous else slots  # a slice: views, no copy of whole slots
        for st in self.states:
            a = self.arena[st.input]
            if st.update == StateUpdate.INPLACE:
                view = a[rows] if contiguous else np.ascontiguousarray(a[slots])
                views[st.input] = view
                self._bind(io, st.input, view, output=False)
                self._bind(io, st.output, view, output=True)
            elif st.update == StateUpdate.APPEND:
                self._bind(io, st.input, self._past(st, rows, p_max), output=False)
                self._bind_new(io, st.output)
            else:  # fixed-shape: replace, prefix (the output is a new buffer, so the input may be the arena's view)
                self._bind(io, st.input, a[rows] if contiguous else np.ascontiguousarray(a[slots]), output=False)
                self._bind_new(io, st.output)
        self._bind_new(io, "logits")
        extra = list(dict.fromkeys([*want, *(n for tap in self.taps for n in tap.outputs)]))
        for name in extra:
            self._bind_new(io, name)
        session.run_with_iobinding(io)
        outs = dict(zip(self._bound_outputs, io.get_outputs(), strict=True))
        for st in self.states:
            if st.update == StateUpdate.INPLACE and not contiguous:
                self.arena[st.input][slots] = views[st.input]
        self._store_states(batch, {st.output: outs[st.output].numpy() for st in self.states
                                   if st.update != StateUpdate.INPLACE}, rows)
        self._keep_alive.clear()
        values = {name: outs[name].numpy() for name in extra}
        for tap in self.taps:
            tap.on_forward(batch, {n: values[n] for n in tap.outputs})
        return outs["logits"].numpy(), values

    def _feeds(self, batch: StepBatch, past: np.ndarray, p_max: int) -> dict[str, np.ndarray]:
        """The step's small inputs the graph takes (ids, positions, mask, lengths, extra inputs), by name."""
        b, s = batch.input_ids.shape
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.ascontiguousarray(batch.input_ids, dtype=np.int64),
            "logits_positions": np.ascontiguousarray(batch.logits_positions, dtype=np.int64)}
        if "position_ids" in self.input_names:
            # Right-padding of a row shorter than the step's widest (a verification beside others) lies past its
            # tokens, beyond the context for a row at its end: clamped into the rotary table (the mask hides those
            # entries and they are never stored), as the TensorRT backend does (tensorrt/arena.py).
            feeds["position_ids"] = np.minimum(past[:, None] + np.arange(s, dtype=np.int64)[None, :],
                                               self.max_seq_len - 1)
        if "attention_mask" in self.input_names:
            mask = np.zeros((b, p_max + s), dtype=np.int64)
            mask[:, :p_max] = np.arange(p_max)[None, :] < past[:, None]
            mask[:, p_max:] = np.arange(s)[None, :] < batch.new_lengths[:, None]
            feeds["attention_mask"] = mask
        if self.uses_gqa:
            total = past + batch.new_lengths
            feeds["seqlens_k"] = (total - 1).astype(np.int32)
            feeds["total_sequence_length"] = np.array(int(total.max()), dtype=np.int32)
        if "past_lengths" in self.input_names:
            feeds["past_lengths"] = past
        for name, arr in (batch.extra_inputs or {}).items():
            feeds[name] = np.ascontiguousarray(arr, dtype=np.float32)
        return {name: arr for name, arr in feeds.items() if name in self.input_names}

    def _past(self, st: Any, rows: slice | list[int], p_max: int) -> np.ndarray:
        """An append state's first ``p_max`` entries of the step's rows, contiguous: only those are copied
        (``a[slots]`` first would copy each row's whole max_seq)."""
        a = self.arena[st.input]
        idx: list[Any] = [slice(None)] * a.ndim
        idx[0], idx[st.seq_axis] = rows, slice(0, p_max)
        return np.ascontiguousarray(a[tuple(idx)])

    def _store_states(self, batch: StepBatch, new: dict[str, np.ndarray], rows: slice | list[int]) -> None:
        """Write a step's state outputs (by output name) into the arena: append states' new entries at each row's
        past length, fixed-shape ones whole."""
        # (slot, first new position, new entries) per row, worked out once for every append state
        spans = [(slot, int(p0), int(n)) for slot, p0, n in zip(batch.slots, batch.past_lengths.tolist(),
                                                                  batch.new_lengths.tolist(), strict=True)]
        for st in self.states:
            a = self.arena[st.input]
            if st.update == StateUpdate.APPEND:
                out = new[st.output]
                lead = (slice(None),) * (st.seq_axis - 1)
                for r, (slot, p0, n) in enumerate(spans):
                    a[(slot, *lead, slice(p0, p0 + n))] = out[(r, *lead, slice(0, n))]
            elif st.update != StateUpdate.INPLACE:
                a[rows] = new[st.output]

    def _step_by_value(self, batch: StepBatch) -> np.ndarray:
        """A step of up to FAST_VERIFY_TOKENS new tokens per row (decode, verification) on adjacent slots of a graph
        whose states all go in by value and come out new (append, prefix, replace: the trt flavor), without taps or
        adapters: its outputs are bound once per (rows, new tokens, logits) to buffers of their own, so a step
        binds only its inputs — the past entries copied out of the arena (slices, no copy of whole slots) — and
        copies the new entries in. The generic path's per-step output bindings and their OrtValues cost ~10 us per
        state (int4 KV: 150 states on SmolLM2); onnxruntime's public ``bind_input`` by pointer another ~6 us per
        input, its binding of a numpy array ~1.5 us (``_input_binder``)."""
        b, s = batch.input_ids.shape
        first, k = batch.slots[0], batch.logits_positions.shape[1]
        bound = self._by_value.get((b, s, k))  # no bound shape depends on the first slot
        if bound is None:
            if len(self._by_value) >= 32:
                self._by_value.clear()
            bound = self._by_value[b, s, k] = self._bind_by_value(b, s, k)
        io, outs = bound
        past = batch.past_lengths.astype(np.int64)
        p_max = int(past.max())
        inputs = self._feeds(batch, past, p_max)
        rows, upto = slice(first, first + b), slice(0, p_max)
        for name, _, a, lead in self._value_states:  # fixed-shape states: the arena's own rows (contiguous)
            inputs[name] = a[rows] if lead is None else np.ascontiguousarray(a[(rows, *lead, upto)])
        # Held by ``inputs`` until the run is over, then unbound: a binding that kept them would hold this step's
        # copies of the past until its next step (up to 32 bindings of them).
        bind = _input_binder(io)
        for name in inputs:
            inputs[name] = arr = np.ascontiguousarray(inputs[name])  # kept by ``inputs``: bound by pointer
            bind(name, arr)
        try:
            self.session.run_with_iobinding(io)
        finally:
            io.clear_binding_inputs()
        spans = [(slot, int(p0), int(n)) for slot, p0, n in zip(batch.slots, batch.past_lengths.tolist(),
                                                                  batch.new_lengths.tolist(), strict=True)]
        for _, output, a, lead in self._value_states:
            out = outs[output]
            if lead is None:
                a[rows] = out
                continue
            for r, (slot, p0, n) in enumerate(spans):
                a[(slot, *lead, slice(p0, p0 + n))] = out[(r, *lead, slice(0, n))]
        return outs["logits"].copy()

    def _bind_by_value(self, b: int, s: int, k: int) -> tuple[Any, dict[str, np.ndarray]]:
        io = self.session.io_binding()
        outs = {"logits": np.zeros((b, k, self.vocab_size), np.float32)}
        for st in self.states:
            shape = list(self.arena[st.input].shape)
            shape[0] = b
            if st.update == StateUpdate.APPEND:
                shape[st.seq_axis] = s
            outs[st.output] = np.zeros(shape, self.arena[st.input].dtype)
        for name, arr in outs.items():
            io.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        return io, outs  # the buffers live as long as the binding that points at them

    def _bind(self, io: Any, name: str, arr: np.ndarray, output: bool) -> None:
        self._keep_alive.append(arr)  # IOBinding holds a raw pointer: the array must outlive the run
        args = (name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        if output:
            io.bind_output(*args)
            self._bound_outputs.append(name)
        else:
            io.bind_input(*args)


    def _bind_new(self, io: Any, name: str) -> None:
        io.bind_output(name, "cpu")
        self._bound_outputs.append(name)


def check_state_dtypes(states: list[StateTensor]) -> None:
    """Refuse in one line a state (KV cache) dtype onnxruntime's CPU arena cannot hold: fp8 is TensorRT's (SM >= 8.9),
    anything else comes from another lineside's build."""
    st = next((s for s in states if s.dtype not in _NP), None)
    if st is None:
        return
    why = ("fp8 KV runs on TensorRT only, on a GPU of SM >= 8.9; serve it there (--backend tensorrt) or rebuild with "
           "--kv-dtype int8" if st.dtype == "float8_e4m3fn" else
           f"it holds {', '.join(sorted(_NP))}; rebuild the bundle with this lineside (--kv-dtype fp16, int8 or int4)")
    raise LinesideError(f"state {st.input} is {st.dtype}, which onnxruntime's CPU backend cannot hold: {why}")


def _input_binder(io: Any) -> Any:
    """``bind(name, array)`` for a CPU input of ``io`` that holds no reference to the array: onnxruntime's own
    binding of a numpy array (the C++ one under ``IOBinding.bind_cpu_input``, which would also keep the array in a
    dict until the name is bound again); its pointer API where that is missing (``IOBinding`` internals moved)."""
    raw = getattr(io, "_iobinding", None)
    if raw is not None and hasattr(raw, "bind_input"):
        return raw.bind_input

    def bind(name: str, arr: np.ndarray) -> None:
        io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
    return bind


# Below this a state tensor is plain np.zeros: no 2 MB huge page would hold it anyway.
_SMALL_STATE = 1 << 21


_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)",
              "int32": "tensor(int32)", "uint8": "tensor(uint8)", PACKED_INT4: "tensor(uint8)"}


def _state_shape(st: StateTensor, declared: tuple[list[Any], str] | None, dims: dict[str, int],
                 graph: str) -> tuple[int, ...]:
    """The arena shape of ``st``: the manifest's shape resolved, once it agrees with the graph's own input (its
    rank, its fixed dims, its type). The manifest is not checksummed: a hand-edited or mismatched shape reached
    numpy (a traceback for a negative or unknown dim, terabytes asked of the allocator for a huge one) or failed
    only in onnxruntime's first step, on every request."""
    if declared is None:
        raise LinesideError(f"state {st.input} in the manifest is not an input of {graph}; the manifest belongs to "
                            "another build: rebuild the bundle or copy it again")
    have, have_type = declared
    ok = len(st.shape) == len(have) and all((isinstance(d, str) and d in dims) or (type(d) is int and d >= 0)
                                            for d in st.shape)
    shape = resolve_shape(st.shape, dims) if ok else ()
    if not ok or _ORT_TYPES[st.dtype] != have_type or \
            any(type(g) is int and g != d for g, d in zip(have, shape, strict=True)):
        raise LinesideError(f"state {st.input} in the manifest is {st.dtype} {st.shape}, but {graph} takes "
                            f"{have_type} {have}; the manifest was edited or belongs to another build: rebuild the "
                            "bundle or copy it again")
    return shape


def arena_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed state tensor whose pages the kernel maps one 4 KB page at a time, on first write.

    numpy asks for transparent huge pages on large arrays (madvise), so the first write into a slot's KV
    faulted in (and, with THP defrag=madvise, compacted memory for) a whole 2 MB page per layer tensor:
    the first decode step that reached a new slot zeroed about 120 MB (SmolLM2, 30 layers x K/V) and took
    0.1-0.8 s instead of 20-60 ms, once per slot, inside the first 8-stream run; RSS also jumped by that
    much per slot. Anonymous memory advised MADV_NOHUGEPAGE costs what a sequence actually writes."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    advise = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if nbytes < _SMALL_STATE or advise is None or not hasattr(mmap.mmap, "madvise"):
        return np.zeros(shape, dtype=dt)
    # private anonymous memory (Python's default for -1 is MAP_SHARED, i.e. shmem): zero pages until written
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    try:
        mem.madvise(advise)
    except OSError:  # a kernel without THP: nothing to advise
        pass
    return np.frombuffer(mem, dtype=dt).reshape(shape)  # the array keeps the mapping alive


def lora_graph_of(bundle: Bundle, flavor: str) -> str:
    """The bundle-relative LoRA graph of ``flavor``; one line when the bundle was built without one."""
    graph = bundle.flavor(flavor).lora_graph
    if graph is None or bundle.manifest.lora is None:
        raise LinesideError(f"bundle {bundle.path} has no LoRA graphs; rebuild it with --max-lora-rank R "
                            "(R: the largest adapter rank to serve) to serve adapters")
    return graph


def _graph_files_sha(bundle: Bundle, graph: str) -> str | None:
    """One digest of the graph file and its external data files as the manifest lists them (None if it
    lists none): what onnxruntime's cached optimized graph is keyed by. The data files beside it count too
    (a layerskip draft graph reads the full graph's ``model.onnx.data``)."""
    if graph not in bundle.manifest.files:
        return None
    folder = graph.rpartition("/")[0] + "/"
    return bundle.manifest.files_digest(
        lambda rel: rel == graph or rel.startswith(graph + ".")
        or (rel.startswith(folder) and rel.endswith(".onnx.data") and "/" not in rel[len(folder):]))

