"""Layerskip draft graphs (`build --draft-layers N`): the model's first N layers + final norm + LM head,
written as a second ONNX file beside the full graph that reads the *same* external-data file (the same
initializers at the same offsets), so the draft costs a few hundred kilobytes of structure, not a second
copy of the weights.

The full graph is cut where layer N starts: the draft keeps every node before it, replaces the final
residual add's inputs with layer N-1's hidden state and residual, and keeps the tail (gather of the
requested positions, final norm, LM head). Its state is the first N layers' KV, named as in the full graph.
A graph whose tail reads the last layer's output as one value (DeepSeek-V4's hyper-connection streams) is cut
with ``write_streams_draft_graph``: the tail reads layer N-1's streams instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from lineside.build.graph.builder import GraphBuilder
from lineside.graph_io import StateTensor


@dataclass(frozen=True)
class LayerMark:
    """Where layer i ends in the emitter's node list: node count, hidden state, residual, states so far."""

    nodes: int
    hidden: str
    residual: str | None
    states: int


def write_draft_graph(gb: GraphBuilder, path: Path, mark: LayerMark, tail_start: int,
                      states: list[StateTensor]) -> dict[str, object]:
    """Save the draft graph cut at ``mark`` to ``path`` (beside ``gb``'s graph); returns its manifest record
    (``graph`` = the file name; the pipeline makes it bundle-relative)."""
    first_tail = gb.nodes[tail_start]
    assert first_tail.op_type == "Add", "the tail starts with the final residual add"
    joined = [mark.hidden] + ([mark.residual] if mark.residual is not None else [])
    head = helper.make_node("Add" if len(joined) == 2 else "Identity", joined, list(first_tail.output),
                            name=first_tail.name + "/draft")
    nodes = [*gb.nodes[:mark.nodes], head, *gb.nodes[tail_start + 1:]]
    return _write_cut(gb, path, nodes, states[:mark.states])


def write_streams_draft_graph(gb: GraphBuilder, path: Path, mark: LayerMark, last_hidden: str, tail_start: int,
                              states: list[StateTensor], inputs: list[str]) -> dict[str, object]:
    """Save the draft cut at ``mark`` for a graph whose tail (from node ``tail_start``: gather, head collapse,
    norm, LM head, state outputs) reads the last layer's output ``last_hidden``: the tail reads ``mark.hidden``
    instead, and only the first ``mark.states`` states remain. ``inputs``: the manifest's non-state inputs."""
    nodes = list(gb.nodes[:tail_start])
    for n in gb.nodes[tail_start:]:
        if last_hidden in n.input:
            n = _renamed_input(n, last_hidden, mark.hidden)
        nodes.append(n)
    record = _write_cut(gb, path, nodes, states[:mark.states])
    record["inputs"] = [i for i in inputs if i in record["inputs"]]  # type: ignore[operator]
    return record


def _renamed_input(node: onnx.NodeProto, old: str, new: str) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    out.input[:] = [new if i == old else i for i in node.input]
    return out


def _write_cut(gb: GraphBuilder, path: Path, nodes: list[onnx.NodeProto],
               kept_states: list[StateTensor]) -> dict[str, object]:
    """Save the cut (``nodes`` pruned to what logits and the kept states' outputs need) beside ``gb``'s graph."""
    assert path.parent == gb.onnx_path.parent, "the draft reads the full graph's data file by relative name"
    outputs = [o for o in gb.outputs if o.name == "logits"] + \
        [o for o in gb.outputs if o.name in {s.output for s in kept_states}]
    name = gb.name + f"-draft{len(kept_states)}"
    nodes = _needed(nodes, {o.name for o in outputs})
    used = {ref for n in nodes for ref in node_reads(n)}
    inits = [t for t in gb.initializers if t.name in used]
    inputs = [i for i in gb.inputs if i.name in used]
    gb.write_graph(path, nodes, inputs, inits, name=name, outputs=outputs)
    return {"graph": path.name, "inputs": [i.name for i in inputs], "state": [s.to_dict() for s in kept_states],
            "weight_fraction": round(initializer_bytes(inits) / max(1, initializer_bytes(gb.initializers)), 4)}


def _needed(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in order (a walk back from them)."""
    want = set(outputs)
    keep = []
    for n in reversed(nodes):
        if any(o in want for o in n.output):
            keep.append(n)
            want.update(node_reads(n))
    return keep[::-1]


def node_reads(node: onnx.NodeProto) -> set[str]:
    """The values a node reads: its inputs and, for If/Loop, every name its subgraphs read from outside
    (an over-approximation: names produced inside a subgraph are unique and match nothing outside)."""
    out = {i for i in node.input if i}
    for attr in node.attribute:
        for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for n in g.node:
                out |= node_reads(n)
    return out


def initializer_bytes(tensors: list[onnx.TensorProto]) -> int:
    """Bytes the tensors' weights take, whether stored inline or as external data (their recorded length)."""
    total = 0
    for t in tensors:
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return total
