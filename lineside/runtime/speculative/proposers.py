"""Makes the proposer a `--speculative` method names, for one engine: prompt lookup costs nothing; a draft
bundle or the bundle's own layerskip graph gets an onnxruntime backend of its own (one slot per target slot).
Each mismatch (another tokenizer, no draft graph, no MTP module) is one line."""

from __future__ import annotations

from lineside.bundle import DRAFT_GRAPHS, MTP_GRAPH, Bundle, open_bundle
from lineside.errors import LinesideError
from lineside.runtime.backend import Backend, has_whole_state
from lineside.runtime.speculative.config import ModelProposer, Proposer, SpecMethod, SpeculativeConfig
from lineside.runtime.speculative.draft_model import DraftModelProposer


def check_speculation(backend: Backend, spec: SpeculativeConfig | None) -> None:
    """Whole-state tensors (DeepSeek-V4's compressor state) advance with every token a step feeds: a backend
    speculates on them only if it can put a row's state back to the accepted length (``save_rows`` /
    ``restore_rows``, step_runner.py); one that keeps the saved rows on a device reserves them now
    (``reserve_rewind``), not in the first verification step."""
    if spec is None:
        return
    if not has_whole_state(backend):
        return
    if not hasattr(backend, "restore_rows"):
        raise LinesideError(f"--speculative {spec.label} is not supported for this model on the {backend.name} "
                            "backend: its decode state has whole-state tensors that a rejected draft would advance, "
                            "and this backend cannot rewind them; use --backend onnxruntime")
    reserve = getattr(backend, "reserve_rewind", None)
    if reserve is not None:
        reserve()


def check_proposer(spec: SpeculativeConfig | None, bundle: Bundle) -> Bundle | None:
    """What can be checked before a model loads (serve/generate/bench run it first): the MTP module, the
    layerskip draft graph, the draft bundle and its tokenizer. Returns the opened draft bundle, if any."""
    if spec is None or spec.method == SpecMethod.NGRAM:
        return None
    if spec.method == SpecMethod.MTP:
        if bundle.architecture != "deepseek_v4":
            raise LinesideError(f"--speculative mtp: {bundle.path.name} ({bundle.architecture}) has no MTP module "
                                "(multi-token prediction: only DeepSeek-V4 checkpoints carry one); use --speculative "
                                "ngram, layerskip:N or draft:BUNDLE")
        if not any(MTP_GRAPH in f.extra for f in bundle.flavors.values()):
            raise LinesideError(f"--speculative mtp: {bundle.path.name} has no MTP module: it is built into the cpu "
                                "flavor from a checkpoint that carries mtp.* tensors (DeepSeek's release files; "
                                "transformers' save_pretrained drops them); rebuild from one with --flavors cpu, or "
                                "use --speculative ngram")
        return None
    if spec.method == SpecMethod.LAYERSKIP:
        built = sorted({int(n) for f in bundle.flavors.values() for n in f.extra.get(DRAFT_GRAPHS) or {}})
        if spec.draft_layers not in built:
            have = ", ".join(f"layerskip:{n}" for n in built) or "none"
            raise LinesideError(f"--speculative {spec.label}: {bundle.path.name} has no {spec.draft_layers}-layer draft "
                                f"graph (built: {have}); rebuild it with `lineside build ... --draft-layers "
                                f"{spec.draft_layers}`")
        return None
    assert spec.draft_bundle is not None
    draft = open_bundle(spec.draft_bundle)
    check_same_tokenizer(bundle, draft)
    return draft


def make_proposer(spec: SpeculativeConfig, bundle: Bundle, backend: Backend, *,
                  threads: int | None = None) -> Proposer | ModelProposer:
    if spec.method == SpecMethod.NGRAM:
        return spec.proposer()
    draft = check_proposer(spec, bundle)
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    if spec.method == SpecMethod.MTP:
        return _mtp_proposer(spec, bundle, backend, threads)
    if spec.method == SpecMethod.LAYERSKIP:
        if not isinstance(backend, OnnxRuntimeBackend):
            raise LinesideError(f"--speculative {spec.label} runs on the onnxruntime backend only (its draft shares "
                                "the target's KV buffers); use --backend onnxruntime, or ngram / draft:BUNDLE")
        flavor = bundle.flavor(backend.flavor)
        drafts = flavor.extra.get(DRAFT_GRAPHS) or {}
        entry = drafts.get(str(spec.draft_layers))
        if entry is None:
            raise LinesideError(f"--speculative {spec.label}: {bundle.path.name} has no {spec.draft_layers}-layer draft "
                                f"graph for its {backend.flavor} flavor; rebuild with `lineside build ... --flavors "
                                f"{backend.flavor} --draft-layers {spec.draft_layers}`")
        draft_be = OnnxRuntimeBackend.draft_of(backend, bundle, entry, threads=threads)
        return DraftModelProposer(draft_be, backend.vocab_size, shares_target_kv=True,
                                  cost=_cost(spec, float(entry.get("weight_fraction", 1.0))))
    assert draft is not None
    draft_be = OnnxRuntimeBackend(draft, num_slots=backend.num_slots, threads=threads,
                                  max_seq_len=min(draft.max_seq_len, backend.max_seq_len), draft_model=True)
    if any(st.update == "replace" for st in draft_be.states):
        draft_be.close()
        raise LinesideError(f"--speculative {spec.label}: the draft bundle's model keeps whole-state tensors "
                            "(DeepSeek-V4); use a Llama or Qwen2 draft bundle")
    return DraftModelProposer(draft_be, backend.vocab_size, cost=_cost(spec, _size_ratio(draft, bundle)))


def _mtp_proposer(spec: SpeculativeConfig, bundle: Bundle, backend: Backend, threads: int | None) -> ModelProposer:
    """The MTP graph on an onnxruntime backend of its own, fed by the target's last-layer streams."""
    from lineside.bundle import FlavorEntry
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from lineside.runtime.speculative.mtp import MtpProposer

    if not isinstance(backend, OnnxRuntimeBackend):
        raise LinesideError("--speculative mtp runs on the onnxruntime backend only (the MTP reads the target's "
                            "hidden states, which the TensorRT engine does not hand out); use --backend onnxruntime")
    record = bundle.flavor(backend.flavor).extra.get(MTP_GRAPH)
    if record is None:
        raise LinesideError(f"--speculative mtp: {bundle.path.name} has no MTP graph for its {backend.flavor} flavor "
                            "(it is built with the cpu flavor); run the cpu flavor")
    entry = FlavorEntry.from_record(record, "MTP graph")
    mtp_be = OnnxRuntimeBackend(bundle, num_slots=backend.num_slots, flavor=backend.flavor, threads=threads,
                                max_seq_len=backend.max_seq_len, spin=backend.spinning, entry=entry,
                                accuracy_level=backend.accuracy_level)
    window = int(entry.state[0].shape[1])
    n, d = (int(v) for v in record["hidden_shape"])
    return MtpProposer(backend, mtp_be, window=window, hidden_shape=(n, d),
                       cost=_cost(spec, float(record.get("weight_fraction", 1.0))))


def check_same_tokenizer(target: Bundle, draft: Bundle) -> None:
    """A draft must speak the target's token ids: the same vocabulary (token → id, added tokens too)."""
    from lineside.runtime.tokenizer import Tokenizer

    a, b = Tokenizer.from_bundle(target), Tokenizer.from_bundle(draft)
    va, vb = a._tok.get_vocab(with_added_tokens=True), b._tok.get_vocab(with_added_tokens=True)
    if va != vb:
        diff = len(set(va.items()) ^ set(vb.items()))
        raise LinesideError(f"--speculative draft:{draft.path}: its tokenizer differs from {target.path.name}'s "
                            f"({len(vb)} vs {len(va)} tokens, {diff} entries differ); a draft model needs the "
                            "target's tokenizer")


def _cost(spec: SpeculativeConfig, estimate: float) -> float:
    return estimate if spec.draft_cost is None else float(spec.draft_cost)


def _size_ratio(draft: Bundle, target: Bundle) -> float:
    """A draft step's cost in target decode steps, estimated from the graphs' weight bytes (decode reads them all)."""
    def weight_bytes(b: Bundle) -> int:
        return b.graph_weight_bytes(b.flavor("cpu" if "cpu" in b.flavors else next(iter(b.flavors), "cpu")).graph)

    t = weight_bytes(target)
    return min(1.0, weight_bytes(draft) / t) if t else 1.0
