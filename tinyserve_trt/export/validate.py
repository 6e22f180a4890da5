"""Numerical validation: the rewritten model against the original, in ONNX Runtime.

A prefill plus decode steps for a batch of sequences of different lengths:
the original runs each sequence alone with its own past/present cache; the
rewritten model runs the whole batch at once over a paged cache (pages
placed out of order on purpose), with a dense budget. The figure is the
largest |logit difference| at the positions both compute.

A package with an INT8 cold tier is validated with every page hot: its cold
inputs hold one unused page (the ``_int8`` overload needs ``Pcold >= 1``), so
the figure checks the rewrite, not the quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ops import schema
from ..ops.fine_bounds import page_sub_bounds
from ..contracts.cold_tier import unused_cold_inputs
from ..ops.reference import page_min_max


@dataclass
class ValidationResult:
    max_abs_diff: float
    steps: int
    batch: int


class PagedState:
    """Minimal paged KV state for validation: a pool per layer, pages handed
    out in a shuffled order, min/max maintained exactly. (The serving runtime
    has its own pool with refcounts and prefix sharing.)"""

    def __init__(self, layers, kv_heads, head_dim, page_size, num_pages, dtype, rng, cold_tier: dict | None = None,
                 sub_page_size: int = 0):
        self.ps = page_size
        self.sp = sub_page_size  # > 0: also the compact sub-page bounds of two-level layers
        self.cold = None
        if cold_tier:  # one cold page nobody uses: ids stay < num_pages, so the op reads the hot pools only
            # per layer: an int4 package's int8_layers take INT8 inputs
            self.cold = [unused_cold_inputs(cold_tier, kv_heads, page_size, head_dim, i) for i in range(layers)]
        shape = (num_pages, kv_heads, page_size, head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(layers)]
        self.v = [np.zeros(shape, dtype) for _ in range(layers)]
        self.kmin = [np.zeros(shape[:2] + shape[3:], dtype) for _ in range(layers)]
        self.kmax = [np.zeros(shape[:2] + shape[3:], dtype) for _ in range(layers)]
        r = page_size // sub_page_size if sub_page_size else 1
        self.sub = [np.zeros((num_pages, kv_heads, r, head_dim), np.uint8) for _ in range(layers)]
        self.free = list(rng.permutation(num_pages))
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self):
        self.tables.append([])
        self.lens.append(0)

    def feeds(self, names, budget: int = 0) -> dict[str, np.ndarray]:
        width = max(1, max(len(t) for t in self.tables))
        pt = np.zeros((len(self.tables), width), np.int32)
        for b, t in enumerate(self.tables):
            pt[b, :len(t)] = t
        f = {"page_table": pt, "past_lens": np.asarray(self.lens, np.int32),
             "token_budget": np.full(len(self.tables), budget, np.int32)}
        for i, layer in enumerate(names):
            f.update({layer["key_cache"]: self.k[i], layer["value_cache"]: self.v[i],
                      layer["key_min"]: self.kmin[i], layer["key_max"]: self.kmax[i]})
            sub_name = layer.get(schema.TWO_LEVEL_INPUTS[0])
            if sub_name:
                f[sub_name] = self.sub[i]
            if self.cold is not None:
                f.update({layer[role]: array for role, array in self.cold[i].items()})
                for name in (layer["key_min"], layer["key_max"], sub_name):  # [P + Pcold] rows
                    if name:
                        f[name] = np.concatenate([f[name], np.zeros_like(f[name][:1])])
        return f

    def write(self, b: int, new_k: list[np.ndarray], new_v: list[np.ndarray], count: int) -> None:
        """Append the first ``count`` new tokens of sequence ``b`` (per layer [Hkv, S, D])."""
        start = self.lens[b]
        for t in range(count):
            pos = start + t
            if pos // self.ps >= len(self.tables[b]):
                self.tables[b].append(int(self.free.pop()))
            page, slot = self.tables[b][pos // self.ps], pos % self.ps
            for i in range(len(self.k)):
                self.k[i][page, :, slot] = new_k[i][:, t]
                self.v[i][page, :, slot] = new_v[i][:, t]
        for j in range(start // self.ps, -(-(start + count) // self.ps)):
            page, valid = self.tables[b][j], min(self.ps, start + count - j * self.ps)
            for i in range(len(self.k)):
                for h in range(self.k[i].shape[1]):
                    self.kmin[i][page, h], self.kmax[i][page, h] = page_min_max(self.k[i][page, h], valid)
                if self.sp:
                    self.sub[i][page] = page_sub_bounds(self.k[i][page], self.sp, self.kmin[i][page],
                                                        self.kmax[i][page], valid)
        self.lens[b] += count


def source_logits(original, manifest: dict, lengths=(7, 12), decode_steps: int = 8,
                  seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """(tokens per sequence, the original's last-token logits [V] per sequence and step): each
    sequence alone with its own cache, a prefill of ``lengths`` then ``decode_steps`` steps on
    teacher-forced random tokens. ``original``: an ORT session of the source."""
    rng = np.random.default_rng([seed, 1])
    vocab, src = manifest["vocab_size"], manifest["source_io"]
    tokens = [rng.integers(0, vocab, n + decode_steps) for n in lengths]
    ref_logits = [[] for _ in lengths]
    out_names = [o.name for o in original.get_outputs()]
    np_type = {"tensor(float16)": np.float16, "tensor(double)": np.float64}
    past_dtype = {i.name: np_type.get(i.type, np.float32) for i in original.get_inputs()}
    for b, n in enumerate(lengths):
        past = {name: np.zeros((1, manifest["num_kv_heads"], 0, manifest["head_dim"]), past_dtype.get(name, np.float32))
                for name in src["past_inputs"]}
        pos = 0
        for step_len in [n] + [1] * decode_steps:
            ids = tokens[b][pos:pos + step_len][None]
            feeds = {src["input_ids"]: ids.astype(np.int64), **past}
            if src.get("attention_mask"):
                feeds[src["attention_mask"]] = np.ones((1, pos + step_len), np.int64)
            if src.get("position_ids"):
                feeds[src["position_ids"]] = np.arange(pos, pos + step_len, dtype=np.int64)[None]
            outs = dict(zip(out_names, original.run(None, feeds)))
            ref_logits[b].append(outs[src["logits"]][0, -1].copy())  # not a view of [1, S, V]
            past = {p: outs[o] for p, o in zip(src["past_inputs"], src["present_outputs"])}
            del outs
            pos += step_len
    return tokens, ref_logits


class SourceReference:
    """The source's logits for validation, computed once per setting from a session of the
    source file that is closed before any rewritten graph loads (one copy of the weights in
    memory at a time), and ``weights_dir``: the folder the rewritten graphs' external weights
    resolve in (the package being written)."""

    def __init__(self, source, weights_dir=None, on_run=None):
        self.source, self.weights_dir, self.on_run = source, weights_dir, on_run
        self._cache: dict = {}

    def logits(self, manifest: dict, lengths, decode_steps: int, seed: int, optimized: bool = True):
        key = (tuple(lengths), decode_steps, seed, optimized)
        if key not in self._cache:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.add_session_config_entry("session.disable_prepacking", "1")
            if not optimized:
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            session = source_session(self.source, so)
            try:
                self._cache[key] = source_logits(session, manifest, lengths, decode_steps, seed)
            finally:
                del session
            if self.on_run:
                self.on_run()
        return self._cache[key]

    def noise(self, manifest: dict, lengths=(7, 12), decode_steps: int = 8, seed: int = 0) -> float:
        """Max |logit diff| of the source against itself, ORT's graph optimizations on vs off: the
        float32 rounding noise of this model, which no rewrite can be held below (SmolLM2's is
        ~1e-5; deeper, wider models' more)."""
        _, on = self.logits(manifest, lengths, decode_steps, seed)
        _, off = self.logits(manifest, lengths, decode_steps, seed, optimized=False)
        return max(float(np.abs(a.astype(np.float64) - b).max()) for r, q in zip(on, off) for a, b in zip(r, q))

    def logit_ulp(self, manifest: dict, lengths=(7, 12), decode_steps: int = 8, seed: int = 0) -> float:
        """The spacing of the source's logits' own dtype at their largest magnitude: 0 for float32
        and wider (its noise dominates), one half-precision step for an fp16 model, whose logits
        no rewrite can match more closely than its own rounding."""
        _, ref = self.logits(manifest, lengths, decode_steps, seed)
        dtype = ref[0][0].dtype
        if np.finfo(dtype).bits >= 32:
            return 0.0
        top = max(float(np.abs(x.astype(np.float32)).max()) for r in ref for x in r)
        return float(np.spacing(dtype.type(top)))


def source_session(path, so):
    """An ORT CPU session of the source file at ``path`` that reads its weights in place: an inline
    model is not parsed whole, by us or by ORT (``proto_scan.py``), so the weights are in memory once."""
    import onnxruntime as ort

    from .proto_scan import load_proto
    from .weights import session_options

    proto = load_proto(path)
    return ort.InferenceSession(proto.SerializeToString(), session_options(so, Path(path).parent),
                                providers=["CPUExecutionProvider"])


def validate(original, rewritten, manifest: dict, lengths=(7, 12), decode_steps: int = 8, seed: int = 0,
             budget: int = 0) -> ValidationResult:
    """``original``: an ORT session of the source or a :class:`SourceReference`; ``rewritten``: an
    ORT session of the paged graph. Teacher-forced random tokens, so both see the same inputs at
    every step whatever they predict."""
    if isinstance(original, SourceReference):
        tokens, ref_logits = original.logits(manifest, lengths, decode_steps, seed)
    else:
        tokens, ref_logits = source_logits(original, manifest, lengths, decode_steps, seed)
    total = [n + decode_steps for n in lengths]
    state = _state(manifest, rewritten, total, np.random.default_rng(seed))
    worst = 0.0
    for b, step, got in _paged_logits(rewritten, state, manifest["io"], tokens, lengths, decode_steps, budget):
        worst = max(worst, float(np.abs(got.astype(np.float64) - ref_logits[b][step]).max()))
    return ValidationResult(worst, decode_steps + 1, len(lengths))


def sparse_lengths(page_size: int) -> tuple[int, int]:
    """Prompt lengths at which a budget of a few pages selects: 5 and 7 pages (+ partial ones)."""
    return 5 * page_size - 3, 7 * page_size + 2


def paged_logits(session, manifest: dict, budget: int, lengths: tuple[int, ...], decode_steps: int = 4,
                 seed: int = 0) -> list[np.ndarray]:
    """Last-token logits [V] of a paged graph of the package ``manifest`` describes (an ORT session),
    sequence-major per step, on teacher-forced random tokens (the same for the same ``seed``): a
    prefill of ``lengths`` tokens, then ``decode_steps`` steps at decode ``budget``. Unlike
    :func:`validate` (dense: the source has no selection to compare with), a budget below the
    lengths runs the selection - two-level's fine score included - so two graphs of one package
    can be compared with it."""
    rng = np.random.default_rng(seed)
    total = [n + decode_steps for n in lengths]
    tokens = [rng.integers(0, manifest["vocab_size"], t) for t in total]
    state = _state(manifest, session, total, np.random.default_rng(seed))
    return [got for _, _, got in _paged_logits(session, state, manifest["io"], tokens, lengths, decode_steps, budget)]


def _state(manifest: dict, session, total, rng) -> PagedState:
    ps = manifest["page_size"]
    dtype = np.float16 if manifest["dtype"] == "float16" else np.float32
    return PagedState(manifest["num_layers"], manifest["num_kv_heads"], manifest["head_dim"], ps,
                      sum(-(-t // ps) for t in total) + 3, dtype, rng, manifest.get("cold_tier"),
                      _sub_page_size(session, manifest["io"]["layers"], ps))


def _paged_logits(rewritten, state: PagedState, io: dict, tokens, lengths, decode_steps: int, budget: int):
    """Yields (sequence, step, last-token logits [V]) of the whole batch run paged: a prefill of
    ``lengths`` tokens, then ``decode_steps`` single tokens (``tokens`` teacher-forced)."""
    for b in range(len(lengths)):
        state.add_sequence()
    out_names = [o.name for o in rewritten.get_outputs()]
    for step in range(decode_steps + 1):
        counts = list(lengths) if step == 0 else [1] * len(lengths)
        S = max(counts)
        ids = np.zeros((len(lengths), S), np.int64)
        pos_ids = np.zeros((len(lengths), S), np.int64)
        for b, c in enumerate(counts):
            start = state.lens[b]
            ids[b, :c] = tokens[b][start:start + c]
            pos_ids[b] = start + np.minimum(np.arange(S), c - 1)
        feeds = state.feeds(io["layers"], budget)
        feeds[io["inputs"]["input_ids"]] = ids
        if "position_ids" in io["inputs"]:
            feeds[io["inputs"]["position_ids"]] = pos_ids
        if "logits_index" in io["inputs"]:
            feeds[io["inputs"]["logits_index"]] = np.asarray(counts, np.int64) - 1
        outs = dict(zip(out_names, rewritten.run(None, feeds)))
        logits = outs[io["outputs"]["logits"]]
        for b, c in enumerate(counts):
            yield b, step, logits[b, 0] if "logits_index" in io["inputs"] else logits[b, c - 1]
            state.write(b, [outs[layer["new_key"]][b] for layer in io["layers"]],
                        [outs[layer["new_value"]][b] for layer in io["layers"]], c)


def _sub_page_size(session, layers, page_size: int) -> int:
    """Sub-page size of the two-level layers (0: none), from the ``key_sub_bounds`` input's
    ``r`` dim: the graph is the record, the manifest does not repeat it."""
    shapes = {i.name: i.shape for i in session.get_inputs()}
    rs = {shapes[layer[n]][2] for layer in layers for n in schema.TWO_LEVEL_INPUTS if n in layer}
    if len(rs) > 1 or any(not isinstance(r, int) for r in rs):
        raise ValueError(f"two-level layers disagree on sub-pages per page: {sorted(map(str, rs))}")
    return page_size // rs.pop() if rs else 0


def graph_session(graph, weights_dir=None):
    """An ORT CPU session of a rewritten graph (an ``onnx.ModelProto`` whose large weights are
    external references into ``weights_dir``), with the native kernel's library when it uses it;
    no MatMul prepacking, so the session holds one copy of the weights."""
    import onnxruntime as ort

    from .native_decode import session_options
    from .weights import session_options as reading_weights

    so = reading_weights(session_options(graph), weights_dir)
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])
