"""The TensorRT backend: the bundle's engine for this GPU, one device allocation, CUDA Graphs for decode.

Per step: place the batch's slots in arena rows 0..B-1 at a pitch that fits (arena.py), copy the
inputs into static buffers, run the engine (``execute_async_v3`` on a non-default stream) and the
state-append kernels — captured once per (batch bucket, tokens per row, logits per row, length bucket) for
decode and speculative verification (1 + k drafts per row, on the decode profile) and replayed —
then copy the logits back. Needs tensorrt + cuda-python + a GPU; each missing piece is one line.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from lineside.bundle import Bundle
from lineside.errors import BackendUnavailable, BundleError, LinesideError
from lineside.graph_io import StateTensor, StateUpdate
from lineside.host_memory import available_memory_bytes
from lineside.lora import LORA_SLOTS_INPUT, LoraAdapter
from lineside.runtime.backend import StepBatch
from lineside.runtime.graph_context import check_rope_positions
from lineside.runtime.kv_bytes import KvArenaBytes, arena_bytes, kv_label
from lineside.runtime.lora_stack import LoraSlotsConfig, LoraStack
from lineside.runtime.tensorrt.arena import ArenaLayout, Relayout, Swap, chunks, gather_chunk_logits
from lineside.runtime.tensorrt.buffers import BufferPlan, check_kv_support, kv_dtype_of, plan_buffers
from lineside.runtime.tensorrt.cuda_errors import lost, sticky
from lineside.runtime.tensorrt.env import (
    check,
    import_cudart,
    import_tensorrt,
    probe_gpu,
)
from lineside.runtime.tensorrt.graphs import GraphCache, batch_buckets, length_buckets
from lineside.runtime.tensorrt.kernels import StateKernels
from lineside.runtime.tensorrt.key import ENGINE_FILE, MachineKey, engine_damage, find_engine, graph_files_sha
from lineside.runtime.tensorrt.lora_buffers import add_lora_buffers
from lineside.runtime.tensorrt.saved_rows import SavePlan, plan_saves
from lineside.runtime.tensorrt.trt_log import capturing_logger


class TensorRTBackend:
    """Backend protocol (runtime/backend.py) on TensorRT; ``num_slots`` ≤ the engine's max batch."""

    name = "tensorrt"
    flavor = "trt"
    # ArenaLayout swaps the step's slots into rows 0..B-1 itself: the scheduler must not move them too.
    needs_contiguous_slots = False
    # A verification step (k+1 tokens per row) reads the same weights as a 1-token step: on a GPU decode is
    # bound by weight reads, so it costs little more. An estimate, not yet measured on a GPU (the adaptive
    # rule's bar, speculative/adaptive.py); every decode row may speculate.
    verify_cost = 1.2

    def __init__(self, bundle: Bundle, num_slots: int = 4, device: int = 0, cuda_graphs: bool = True,
                 warmup: bool = True, lora: LoraSlotsConfig | None = None):
        self.trt = import_tensorrt()
        self.cr = import_cudart()
        gpu = probe_gpu(device)
        check(self.cr, self.cr.cudaSetDevice(device), "cudaSetDevice")
        check(self.cr, self.cr.cudaFree(0), "cudaFree(0)")  # creates the primary context (NVRTC modules need it)
        here = MachineKey(gpu.name, gpu.sm, str(self.trt.__version__), gpu.cuda_runtime)
        fl = bundle.flavor("trt")
        check_kv_support(fl.state, gpu.sm)
        check_rope_positions(bundle.file(fl.graph), fl.graph, bundle.max_seq_len, bundle.config.context_limit)
        # With adapter slots: the LoRA graph's engine (built with --max-loras/--max-lora-rank), whose extra inputs
        # are the stacked adapters (device copies, fixed addresses) and the rows' slot ids (captured like input_ids).
        self.lora: LoraStack | None = None
        graph_sha = bundle.manifest.graph_sha("trt")
        if lora is not None:
            from lineside.lora import LoraTarget
            from lineside.runtime.onnxruntime_backend import lora_graph_of

            graph_sha = bundle.manifest.files[lora_graph_of(bundle, "trt")].sha256
            assert bundle.manifest.lora is not None
            # padded: fixed shapes and addresses, so the captured graphs replay whatever is loaded
            self.lora = LoraStack(bundle.config, tuple(LoraTarget(t) for t in bundle.manifest.lora.targets), lora,
                                  packed=False)
        edir, meta = find_engine(bundle.path, here, graph_sha,
                                 lora=None if lora is None else (lora.max_loras, lora.max_rank),
                                 content=graph_files_sha(bundle.manifest))
        if meta.get("kv_dtype", "fp16") != kv_dtype_of(fl.state):
            raise BundleError(f"engine {edir.name} was built for a {meta.get('kv_dtype', 'fp16')} KV cache but the "
                              f"bundle's trt graph stores {kv_dtype_of(fl.state)}; rebuild with `lineside engine "
                              f"{bundle.path}`")
        lim = meta["limits"]
        if num_slots > int(lim["max_batch"]):
            raise LinesideError(f"the engine was built for at most {lim['max_batch']} slots, {num_slots} asked; "
                               f"rebuild with `lineside engine {bundle.path} --slots {num_slots}`")
        self.bundle, self.num_slots = bundle, num_slots
        self.max_seq_len = bundle.max_seq_len
        self.vocab_size = bundle.config.vocab_size
        self.max_prefill, self.max_logits = int(lim["max_prefill"]), int(lim["max_logits"])
        # Decode-profile width: 1 + speculative drafts (engines built before verification steps: 1).
        self.max_verify = int(lim.get("max_verify", 1))
        self.cuda_graphs = cuda_graphs
        self.states = list(fl.state)
        self.input_names = list(fl.inputs) + ([LORA_SLOTS_INPUT, *self.lora.arrays] if self.lora else [])
        self.stats = {"replay": 0, "captured": 0, "eager": 0, "relayouts": 0, "swaps": 0}

        self.engine = self._deserialize(Path(edir, ENGINE_FILE), meta)
        names = [p["name"] for p in meta["profiles"]]
        self.stream = check(self.cr, self.cr.cudaStreamCreateWithFlags(self.cr.cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags")
        # The prefill and decode contexts never run at the same time (one stream), so they share one block
        # of activation memory sized for the larger profile instead of holding one each (Jetson memory is
        # shared with the CPU; TensorRT-Edge-LLM does the same).
        self.contexts: dict[str, Any] = {}
        user_managed = self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
        self.context_memory_bytes = max(int(self.engine.device_memory_size_v2), 1)
        self.plan: BufferPlan = plan_buffers(
            self.states, bundle.config, num_slots=num_slots, max_seq=self.max_seq_len, max_prefill=self.max_prefill,
            max_logits=self.max_logits, vocab=self.vocab_size, input_names=self.input_names)
        if self.lora is not None:
            add_lora_buffers(self.plan, self.lora.arrays, num_slots)
        self._check_memory(device, integrated=gpu.integrated)
        self.context_memory = check(self.cr, self.cr.cudaMalloc(self.context_memory_bytes), "cudaMalloc")
        for i, n in enumerate(names):
            ctx = self.engine.create_execution_context(user_managed)
            if ctx is None:
                raise BackendUnavailable(f"TensorRT could not create an execution context for the {n} profile "
                                         "(out of GPU memory?); use fewer --slots or --backend onnxruntime")
            ctx.set_device_memory(int(self.context_memory), self.context_memory_bytes)
            ctx.set_optimization_profile_async(i, int(self.stream))
            self.contexts[n] = ctx

        self.base = check(self.cr, self.cr.cudaMalloc(self.plan.total), "cudaMalloc")
        # whole-state rows kept across a verification step (speculation only: allocated by reserve_rewind)
        self.saves: SavePlan = plan_saves(self.plan.states, num_slots)
        self.save_base: int | None = None
        check(self.cr, self.cr.cudaMemsetAsync(self.base, 0, self.plan.total, self.stream), "cudaMemsetAsync")
        # pinned staging for the step inputs, one region per buffer (rewritten only after the step's final sync)
        self.staging: dict[str, int] = {}
        host_bytes = 0
        for b in self.plan.buffers.values():
            if b.role in ("input", "control"):
                self.staging[b.name] = host_bytes
                host_bytes += -(-b.nbytes // 256) * 256
        self.pinned = check(self.cr, self.cr.cudaMallocHost(host_bytes), "cudaMallocHost")
        self.host = np.ctypeslib.as_array((ctypes.c_uint8 * host_bytes).from_address(int(self.pinned)))
        self.kernels = StateKernels(gpu.sm)
        self.layout = ArenaLayout(num_slots, self.max_seq_len,
                                  length_buckets(self.max_seq_len, int(lim["first_bucket"]), int(lim["bucket_step"])),
                                  batch_buckets(num_slots))
        self.graphs = GraphCache(self.cr, self.stream)
        self._check_engine_io()
        if self.lora is not None:
            self._upload_lora()  # the column -> slot maps (and zeros for the empty slots)
        if warmup:
            self.warmup()

    def _check_memory(self, device: int, *, integrated: bool = False) -> None:
        """Refuse, before allocating, a KV arena and buffers that the GPU's free memory cannot hold: one line with
        the numbers and the flag to lower, instead of cudaMalloc's cudaErrorMemoryAllocation. On an integrated GPU
        (Jetson) the host's MemAvailable counts too: the bundle just read sits in page cache the kernel gives back."""
        free, total = check(self.cr, self.cr.cudaMemGetInfo(), "cudaMemGetInfo")
        if integrated:
            free = max(int(free), available_memory_bytes() or 0)
        arena = sum(b.nbytes for b in self.plan.buffers.values() if b.role == "arena")
        need = self.plan.total + self.context_memory_bytes
        if need <= int(free):
            return
        gib = 1 << 30
        raise BackendUnavailable(
            f"the TensorRT backend needs {need / gib:.2f} GiB of GPU memory for --num-slots {self.num_slots} (KV "
            f"cache {arena / gib:.2f} GiB for {self.num_slots} x {self.max_seq_len} positions, other buffers "
            f"{(self.plan.total - arena) / gib:.2f} GiB, TensorRT activations {self.context_memory_bytes / gib:.2f} "
            f"GiB) but GPU {device} has {int(free) / gib:.2f} GiB free of {int(total) / gib:.2f} GiB; lower "
            f"--num-slots, or rebuild the bundle with a smaller --max-seq-len")

    def _deserialize(self, plan: Path, meta: dict[str, Any]) -> Any:
        """The engine from its plan file, or one line naming the file, TensorRT's reason (a plan built by another
        TensorRT or for another GPU, a corrupt file) and the rebuild command. A plan that is not the one its
        engine.json sealed (cut short, changed) is refused before TensorRT sees it."""
        rebuild = f"rebuild it on this machine with `lineside engine {self.bundle.path}`"
        try:
            data = plan.read_bytes()
        except OSError as e:
            raise BackendUnavailable(f"cannot read the TensorRT engine {plan} ({e.strerror or e}); {rebuild}") from None
        damage = engine_damage(plan.parent, meta, data)
        if damage is not None:
            raise BackendUnavailable(f"TensorRT engine not loaded: {damage}; {rebuild}")
        logger = capturing_logger(self.trt)
        self.runtime = self.trt.Runtime(logger)
        engine = self.runtime.deserialize_cuda_engine(data) if data else None
        if engine is None:
            why = logger.errors[-1] if logger.errors else ("the file is empty" if not data else
                                                           "corrupt, or built by another TensorRT")
            raise BackendUnavailable(f"TensorRT could not load the engine {plan} ({why}); {rebuild}")
        return engine

    # ---- LoRA slots (LoraBackend) ------------------------------------------------------
    @property
    def max_loras(self) -> int:
        return 0 if self.lora is None else self.lora.slots.max_loras

    @property
    def max_lora_rank(self) -> int:
        return 0 if self.lora is None else self.lora.slots.max_rank

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Fill the slot in the host stack and copy the stack to its fixed device buffers: a captured decode
        graph reads the new adapter at its next replay, nothing is captured again."""
        if self.lora is None:
            raise LinesideError("this TensorRT backend runs the base engine; start it with adapter slots")
        self.lora.load(slot, adapter)
        self._upload_lora()

    def unload_adapter(self, slot: int) -> None:
        if self.lora is not None:
            self.lora.unload(slot)
            self._upload_lora()

    def _upload_lora(self) -> None:
        assert self.lora is not None
        for name, arr in self.lora.arrays.items():
            check(self.cr, self.cr.cudaMemcpyAsync(self._addr(name), arr.ctypes.data, arr.nbytes,
                                                   self.cr.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream),
                  "cudaMemcpyAsync")
        self.sync()  # the host arrays may change again right after

    # ---- helpers -----------------------------------------------------------------------
    def _addr(self, name: str) -> int:
        return self.plan.address(int(self.base), name)

    def _check_engine_io(self) -> None:
        want = set(self.input_names) | {s.input for s in self.states} | {s.output for s in self.states} | {"logits"}
        have = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if want != have:
            raise BackendUnavailable(f"the engine's tensors {sorted(have ^ want)} do not match the bundle's trt graph; "
                                     f"rebuild with `lineside engine {self.bundle.path}`")
        for ctx in self.contexts.values():
            for n in have:
                ctx.set_tensor_address(n, self._addr(n))

    def _h2d(self, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        off = self.staging[name]
        self.host[off: off + arr.nbytes] = arr.view(np.uint8).reshape(-1)
        check(self.cr, self.cr.cudaMemcpyAsync(self._addr(name), int(self.pinned) + off, arr.nbytes,
                                               self.cr.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream),
              "cudaMemcpyAsync")

    def sync(self) -> None:
        check(self.cr, self.cr.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def _d2d(self, dst: int, src: int, n: int) -> None:
        check(self.cr, self.cr.cudaMemcpyAsync(dst, src, n, self.cr.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                               self.stream), "cudaMemcpyAsync")

    def _apply(self, moves: list[Swap | Relayout]) -> None:
        scratch = self._addr("scratch")
        for mv in moves:
            for lay in self.plan.states:
                arena = self._addr(lay.state.input)
                if isinstance(mv, Relayout):
                    if lay.update != StateUpdate.APPEND:
                        continue
                    e = lay.inner * lay.dtype.itemsize
                    rows = self.num_slots * lay.outer
                    old, new = mv.old_pitch * e, mv.new_pitch * e
                    self._d2d(scratch, arena, rows * old)
                    check(self.cr, self.cr.cudaMemcpy2DAsync(arena, new, scratch, old, min(old, new), rows,
                                                             self.cr.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                                             self.stream), "cudaMemcpy2DAsync")
                else:
                    rb = lay.row_bytes(self.layout.pitch)
                    a, b = arena + mv.row_a * rb, arena + mv.row_b * rb
                    self._d2d(scratch, a, rb)
                    self._d2d(a, b, rb)
                    self._d2d(b, scratch, rb)
            self.stats["relayouts" if isinstance(mv, Relayout) else "swaps"] += 1

    def _set_shapes(self, ctx: Any, bb: int, s: int, p: int, k: int) -> None:
        shapes = {"input_ids": (bb, s), "position_ids": (bb, s), "attention_mask": (bb, p + s),
                  "logits_positions": (bb, k), "past_lengths": (bb,)}
        if self.lora is not None:
            shapes[LORA_SLOTS_INPUT] = (bb,)
            shapes.update({n: tuple(a.shape) for n, a in self.lora.arrays.items()})
        for lay in self.plan.states:
            if lay.update == StateUpdate.APPEND:
                full = self.plan.buffers[lay.state.input].shape
                shapes[lay.state.input] = self._state_shape(lay.state, bb, p, full)
            else:
                shapes[lay.state.input] = (bb, *self._replace_dims(lay.state))
        for n in [*self.input_names, *(lay.state.input for lay in self.plan.states)]:
            # TensorRT answers False (and logs) for a shape outside the context's profile: this step fails, and
            # says which input, instead of running with the last shape set
            if n in shapes and not ctx.set_input_shape(n, shapes[n]):
                raise LinesideError(f"input {n} shape {tuple(shapes[n])} is outside the TensorRT engine's profile "
                                    f"(built for at most {self.num_slots} slots, {self.max_prefill} prefill tokens); "
                                    f"rebuild with `lineside engine {self.bundle.path}` and larger limits")

    def _state_shape(self, st: StateTensor, bb: int, p: int, full: tuple[int, ...]) -> tuple[int, ...]:
        from lineside.runtime.tensorrt.buffers import state_dims
        dims = state_dims(self.bundle.config) | {"max_seq": self.max_seq_len, "batch": bb, "past_seq": p}
        return tuple(int(d) if isinstance(d, int) else int(dims[d]) for d in st.shape)

    def _replace_dims(self, st: StateTensor) -> tuple[int, ...]:
        from lineside.runtime.tensorrt.buffers import state_dims
        dims = state_dims(self.bundle.config) | {"max_seq": self.max_seq_len}
        return tuple(int(d) if isinstance(d, int) else int(dims[d]) for d in st.shape[1:])

    def _launch_fn(self, ctx: Any, bb: int, s: int, p: int) -> Any:
        def launch() -> None:
            if not ctx.execute_async_v3(int(self.stream)):
                self._execute_failed(bb, s, p)
            for lay in self.plan.states:
                src, dst = self._addr(lay.state.output), self._addr(lay.state.input)
                if lay.update == StateUpdate.APPEND:
                    self.kernels.append_rows(self.stream, src, dst, self._addr("write_pos"), self._addr("new_lengths"),
                                             bb, lay.outer, s, p, lay.inner * lay.dtype.itemsize)
                else:
                    self.kernels.copy_rows(self.stream, src, dst, self._addr("write_pos"), bb, lay.row_bytes(p))
        return launch

    def _execute_failed(self, bb: int, s: int, p: int) -> None:
        """execute_async_v3 answered False: after a sticky CUDA error (a fault in an earlier step's kernel) the
        context is lost (BackendLost); anything else (out of memory at a larger shape) fails only this step."""
        err = self.cr.cudaGetLastError()[0]  # returns a sticky error, clears a recoverable one
        gone = sticky(err)
        if gone is not None:
            raise lost(gone, "TensorRT execute_async_v3")
        cause = "" if int(err) == 0 else f", last CUDA error {getattr(err, 'name', err)}"
        raise LinesideError(f"TensorRT execute_async_v3 failed for {bb} rows x {s} tokens after {p} cached "
                            f"positions{cause} (see the TensorRT log above)")

    # ---- Backend interface ----------------------------------------------------------------
    def kv_arena_bytes(self) -> KvArenaBytes:
        """The arena buffers of the one device allocation (every state, all slots), for the /metrics KV gauges."""
        arena = [b for b in self.plan.buffers.values() if b.role == "arena"]
        return arena_bytes(kv_label(self.bundle.manifest.quantization, (b.dtype for b in arena)),
                           (b.nbytes for b in arena), num_slots=self.num_slots, max_seq_len=self.max_seq_len,
                           sequence_bytes=sum(self.plan.buffers[lay.state.input].nbytes for lay in self.plan.states
                                              if lay.update == StateUpdate.PREFIX))

    def forward(self, batch: StepBatch) -> np.ndarray:
        """One step for the batch's slots; returns float32 logits [B, K, vocab]."""
        past = np.asarray(batch.past_lengths, dtype=np.int64)
        new = np.asarray(batch.new_lengths, dtype=np.int64)
        totals = past + new
        if "attention_mask" not in self.input_names and len(set(new.tolist())) > 1:
            return self._by_new_length(batch)
        self._apply(self.layout.plan_moves(list(batch.slots), totals))
        parts = []
        for ch in chunks(batch.input_ids, new, batch.logits_positions, min(self.max_prefill, self.max_logits)
                         if batch.logits_positions.shape[1] > self.max_logits else self.max_prefill):
            cpast = past + np.minimum(ch.offset, new)
            st = self.layout.step_inputs(ch.input_ids, cpast, ch.new_lengths, ch.logits_positions)
            for name, arr in (("input_ids", st.input_ids), ("position_ids", st.position_ids),
                              ("attention_mask", st.attention_mask), ("logits_positions", st.logits_positions),
                              ("past_lengths", st.past_lengths)):
                if name in self.input_names:
                    self._h2d(name, arr)
            if self.lora is not None:  # each row's adapter slot; padding rows use none
                rows = np.zeros(st.batch_bucket, dtype=np.int64)
                rows[:st.rows] = batch.adapter_rows()
                self._h2d(LORA_SLOTS_INPUT, rows)
            self._h2d("write_pos", st.write_pos)
            self._h2d("new_lengths", st.new_lengths)
            k = st.logits_positions.shape[1]
            # 1-token decode and verification steps (≤ 1 + drafts tokens per row, logits at each) run on the
            # decode profile, replayed from a CUDA Graph per (batch bucket, tokens per row, logits, length bucket)
            decode = st.is_decode or (k == st.seq <= self.max_verify)
            ctx = self.contexts["decode" if decode else "prefill"]
            self._set_shapes(ctx, st.batch_bucket, st.seq, st.past_seq, k)
            launch = self._launch_fn(ctx, st.batch_bucket, st.seq, st.past_seq)
            if decode and self.cuda_graphs:
                past_key = st.past_seq if any(lay.update == StateUpdate.APPEND for lay in self.plan.states) else 0
                self.stats[self.graphs.run((st.batch_bucket, st.seq, k, past_key), launch)] += 1
            else:
                launch()
                self.stats["eager"] += 1
            parts.append((ch, self._logits(st.rows, k)))
        self.layout.commit(list(batch.slots), totals)
        return gather_chunk_logits(parts, batch.logits_positions.shape[1])

    def _by_new_length(self, batch: StepBatch) -> np.ndarray:
        """A graph without an attention mask takes one new length per call: run the rows of each length together
        (speculative verification mixes 1-token rows with 1 + k-token ones). A part whose logits columns past its
        length only repeat its last position asks for its length's columns alone, so 1-token rows replay the plain
        decode graph."""
        b, k = batch.logits_positions.shape
        out = np.empty((b, k, self.vocab_size), dtype=np.float32)
        new = np.asarray(batch.new_lengths)
        for n in sorted(set(new.tolist())):
            rows = np.nonzero(new == n)[0]
            lp = np.asarray(batch.logits_positions)[rows]
            width = n if 0 < n < k and (lp[:, n:] == lp[:, n - 1:n]).all() else k
            part = StepBatch(slots=[batch.slots[r] for r in rows],
                             input_ids=np.ascontiguousarray(np.asarray(batch.input_ids)[rows][:, :max(n, 1)]),
                             past_lengths=np.asarray(batch.past_lengths)[rows], new_lengths=new[rows],
                             logits_positions=np.ascontiguousarray(lp[:, :width]), adapters=batch.adapter_rows()[rows])
            got = self.forward(part)
            out[rows, :width] = got
            out[rows, width:] = got[:, width - 1:width]
        return out

    def _logits(self, rows: int, k: int) -> np.ndarray:
        out = np.empty((rows, k, self.vocab_size), dtype=np.float32)
        check(self.cr, self.cr.cudaMemcpyAsync(out.ctypes.data, self._addr("logits"), out.nbytes,
                                               self.cr.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream),
              "cudaMemcpyAsync")
        self.sync()
        return out

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        if src == dst:
            return
        if any(lay.update == StateUpdate.REPLACE for lay in self.plan.states) and length != int(self.layout.lengths[src]):
            raise LinesideError("this model's decode state has fixed-size parts; only whole sequences can be "
                               "copied between slots")
        ra, rb = self.layout.copied(src, dst, length)
        for lay in self.plan.states:
            rbytes = lay.row_bytes(self.layout.pitch)
            base = self._addr(lay.state.input)
            self._d2d(base + rb * rbytes, base + ra * rbytes, rbytes)
        self.sync()

    # ---- speculative rewind (step_runner.py: save before a verification step, restore a row that kept less) --
    def reserve_rewind(self) -> None:
        """Allocate the save area once (check_speculation calls it when the engine starts with speculation), so
        no verification step allocates and a server without speculation holds none of it."""
        if self.save_base is None and self.saves.layouts:
            self.save_base = check(self.cr, self.cr.cudaMalloc(self.saves.total), "cudaMalloc")

    def save_rows(self, slots: list[int]) -> dict[int, int]:
        """Copy ``slots``' whole-state rows to the save area (device to device, on the backend's stream, so
        ordered before the step that follows; outside any captured graph). Returns the handle ``restore_rows``
        takes: each slot's save epoch."""
        self.reserve_rewind()
        out = {}
        for slot in slots:
            self.layout.check_slot(slot)
            row = self.layout.phys_of[slot]
            for lay in self.saves.layouts:
                rb = lay.row_bytes(self.layout.pitch)
                assert self.save_base is not None
                self._d2d(self.saves.row(int(self.save_base), lay, slot), self._addr(lay.state.input) + row * rb, rb)
            out[slot] = self.saves.saved(slot)
        return out

    def restore_rows(self, saved: dict[int, int], slot: int) -> None:
        """Put ``slot``'s whole-state rows back as ``save_rows`` found them, into the arena row the slot holds
        now (the step between may have swapped rows); stream-ordered before the step that feeds the kept tokens."""
        self.layout.check_slot(slot)
        self.saves.check(slot, saved.get(slot))
        assert self.save_base is not None
        row = self.layout.phys_of[slot]
        for lay in self.saves.layouts:
            rb = lay.row_bytes(self.layout.pitch)
            self._d2d(self._addr(lay.state.input) + row * rb, self.saves.row(int(self.save_base), lay, slot), rb)

    def reset_slot(self, slot: int) -> None:
        self.layout.reset(slot)
        row = self.layout.phys_of[slot]
        for lay in self.plan.states:
            if lay.update != StateUpdate.APPEND:  # fixed-size state starts from zeros
                rbytes = lay.row_bytes(self.layout.pitch)
                check(self.cr, self.cr.cudaMemsetAsync(self._addr(lay.state.input) + row * rbytes, 0, rbytes,
                                                       self.stream), "cudaMemsetAsync")
        self.sync()

    def warmup(self) -> None:
        """Run (and capture) one decode step per batch bucket at the first length bucket, then clear the slots."""
        for bb in self.layout.batch_buckets:
            slots = list(range(bb))
            self.forward(StepBatch(slots=slots, input_ids=np.zeros((bb, 1), dtype=np.int64),
                                   past_lengths=np.zeros(bb, dtype=np.int64), new_lengths=np.ones(bb, dtype=np.int64),
                                   logits_positions=np.zeros((bb, 1), dtype=np.int64)))
            for s in slots:
                self.reset_slot(s)

    def close(self) -> None:
        if getattr(self, "graphs", None) is not None:
            self.graphs.drop()
        self.contexts = {}  # contexts go before the memory they use
        for attr in ("base", "context_memory", "save_base"):
            if getattr(self, attr, None) is not None:
                self.cr.cudaFree(getattr(self, attr))
                setattr(self, attr, None)
        if getattr(self, "pinned", None) is not None:
            self.cr.cudaFreeHost(self.pinned)
            self.pinned = None
        if getattr(self, "stream", None) is not None:
            self.cr.cudaStreamDestroy(self.stream)
            self.stream = None
