"""Run a KV-cache ONNX export and its torch twin side by side.

A ``Scenario`` is a batch of prompts (token ids, possibly different lengths)
followed by a few single-token decode steps. ``run_torch`` and ``run_onnx``
drive the two through the same steps with the interface of
``torch_export`` (flat past in, full presents out) and return, per step,
the logits and presents as numpy arrays plus the attention mask used, so
callers compare only the positions the mask marks valid.

Padding convention: LEFT padding (the transformers ``generate`` one). Pad
slots carry mask 0; position ids count valid tokens only (pad slots get 1,
as in ``generate``). A pad query row sees no valid key, so its logits and
its layer>0 K/V are exporter-defined garbage: compare under ``valid_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StepResult:
    """One forward call. ``logits`` [batch, seq, vocab]; ``presents`` the flat
    (key0, value0, ...) [batch, kv_heads, total, head_dim]; ``attention_mask``
    [batch, total] (1 = valid); ``query_mask`` [batch, seq] (1 = valid query)."""

    logits: np.ndarray
    presents: tuple[np.ndarray, ...]
    attention_mask: np.ndarray
    query_mask: np.ndarray


@dataclass(frozen=True)
class Scenario:
    """Prompts (left-padded to the longest) plus ``decode_steps`` greedy steps.
    Decode tokens are fixed up front (``decode_tokens``) so both runners see
    the same inputs even where their argmax would differ by round-off."""

    prompts: tuple[tuple[int, ...], ...]
    decode_steps: int = 2
    seed: int = 0
    vocab_size: int = 256
    decode_tokens: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise ValueError("every prompt needs at least one token")
        if self.decode_steps < 0:
            raise ValueError(f"decode_steps must be >= 0, got {self.decode_steps}")
        if not self.decode_tokens:
            rng = np.random.default_rng(self.seed)
            toks = rng.integers(0, self.vocab_size, size=(self.decode_steps, len(self.prompts)))
            object.__setattr__(self, "decode_tokens", tuple(tuple(int(t) for t in row) for row in toks))

    @classmethod
    def random(cls, lengths: tuple[int, ...], vocab_size: int, decode_steps: int = 2, seed: int = 0):
        rng = np.random.default_rng(seed + 100)
        prompts = tuple(tuple(int(t) for t in rng.integers(0, vocab_size, size=n)) for n in lengths)
        return cls(prompts=prompts, decode_steps=decode_steps, seed=seed, vocab_size=vocab_size)

    def steps(self):
        """Yield (input_ids, attention_mask, position_ids, query_mask) int64 arrays
        for the prefill and then each decode step (masks cover past + new)."""
        batch, longest = len(self.prompts), max(len(p) for p in self.prompts)
        ids = np.zeros((batch, longest), dtype=np.int64)
        mask = np.zeros((batch, longest), dtype=np.int64)
        for b, prompt in enumerate(self.prompts):
            ids[b, longest - len(prompt):] = prompt
            mask[b, longest - len(prompt):] = 1
        pos = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
        yield ids, mask, pos, mask.copy()
        next_pos = mask.sum(axis=1)
        for step in self.decode_tokens:
            mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
            yield (np.array(step, dtype=np.int64)[:, None], mask, next_pos[:, None].copy(),
                   np.ones((batch, 1), dtype=np.int64))
            next_pos = next_pos + 1


def _empty_past(num_layers: int, batch: int, kv_heads: int, head_dim: int):
    return tuple(np.zeros((batch, kv_heads, 0, head_dim), dtype=np.float32) for _ in range(2 * num_layers))


def run_torch(model, scenario: Scenario) -> list[StepResult]:
    """Drive ``model`` (HF causal LM) through the scenario via the export wrapper."""
    import torch

    from tinyserve_trt.export.hf.torch_export import cache_geometry, make_wrapper

    layers, kv_heads, head_dim = cache_geometry(model.config)
    wrapper = make_wrapper(model)
    past = _empty_past(layers, len(scenario.prompts), kv_heads, head_dim)
    results = []
    with torch.no_grad():
        for ids, mask, pos, qmask in scenario.steps():
            flat = wrapper(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(pos),
                           *(torch.from_numpy(p) for p in past))
            out = [t.detach().float().numpy() for t in flat]
            past = tuple(out[1:])
            results.append(StepResult(out[0], past, mask, qmask))
    return results


def run_onnx(session_or_path, scenario: Scenario) -> list[StepResult]:
    """Drive an ONNX Runtime session (or a model path, CPU EP) through the scenario."""
    if isinstance(session_or_path, (str, bytes)) or hasattr(session_or_path, "__fspath__"):
        import onnxruntime as ort

        session = ort.InferenceSession(str(session_or_path), providers=["CPUExecutionProvider"])
    else:
        session = session_or_path
    inputs = {i.name: i for i in session.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    shape = inputs[past_names[0]].shape
    kv_heads, head_dim = int(shape[1]), int(shape[3])
    past = _empty_past(len(past_names) // 2, len(scenario.prompts), kv_heads, head_dim)
    out_names = [o.name for o in session.get_outputs()]
    results = []
    for ids, mask, pos, qmask in scenario.steps():
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        feed.update(zip(past_names, past))
        feed = {k: v for k, v in feed.items() if k in inputs}
        out = dict(zip(out_names, session.run(out_names, feed)))
        present_names = [n.replace("past_key_values.", "present.") for n in past_names]
        past = tuple(out[n] for n in present_names)
        results.append(StepResult(out["logits"], past, mask, qmask))
    return results


def max_abs_diff(a: list[StepResult], b: list[StepResult]) -> dict[str, float]:
    """Largest |a - b| over valid positions, per step kind: keys
    ``logits`` and ``presents`` (max over steps, layers)."""
    worst = {"logits": 0.0, "presents": 0.0}
    for x, y in zip(a, b, strict=True):
        q = x.query_mask.astype(bool)
        worst["logits"] = max(worst["logits"], float(np.abs(x.logits - y.logits)[q].max()))
        k = x.attention_mask.astype(bool)
        for px, py in zip(x.presents, y.presents, strict=True):
            diff = np.abs(px - py).transpose(0, 2, 1, 3)[k]
            worst["presents"] = max(worst["presents"], float(diff.max()))
    return worst
