"""The ``hf`` ObservationSource: a transformers causal LM (LLaMA-style attention) in torch.

Queries, keys and values are captured with a forward pre-hook on every
``self_attn`` that recomputes the projections and rotary from its inputs
(``hidden_states``, ``position_embeddings``), so nothing depends on the
cache classes of one transformers version; the cache for evaluation is
rebuilt from (possibly transformed) K/V tensors. CPU, fp32, batch 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyserve_trt.calibration.selection import replay_selection
from tinyserve_trt.calibration.source import KVTransform, Observation, ObservationSource, register_source
from tinyserve_trt.ops import schema


class HFSource(ObservationSource):
    def __init__(self, model_dir: str, page_size: int = 16, token_budget: int = 256, decode_steps: int = 8,
                 attrs: schema.OpAttributes | None = None, threads: int | None = None, sub_page_size: int = 0,
                 dense_layers: int = 0, group_reduce: str | None = None, candidate_share: float | None = None):
        """``attrs``: the sparse layers' op attributes (default: the schema's, with ``sub_page_size``,
        ``group_reduce`` and ``candidate_share`` where given - a package's selection rule);
        ``dense_layers``: leading layers replayed as the dense policy (an exported package's)."""
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.page_size, self.token_budget, self.decode_steps = page_size, token_budget, decode_steps
        given = {k: v for k, v in (("group_reduce", group_reduce), ("candidate_share", candidate_share))
                 if v is not None}
        self.attrs = attrs or schema.OpAttributes(sub_page_size=sub_page_size, **given)
        self.dense_layers = dense_layers
        self._captured: dict[int, tuple] = {}
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: PLC0415

        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            cos, sin = kwargs.get("position_embeddings") or args[1]
            shape = (*h.shape[:-1], -1, self.head_dim)
            q = module.q_proj(h).view(shape).transpose(1, 2)
            k = module.k_proj(h).view(shape).transpose(1, 2)
            v = module.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self._captured[module.layer_idx] = (q[0].numpy(), k[0].numpy(), v[0].numpy())

        self._hook = hook
        import inspect  # noqa: PLC0415

        # transformers renamed past_key_values -> cache (deprecated until 5.40)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._attn = [layer.self_attn for layer in self.model.model.layers]

    def op_settings(self) -> dict:
        return dict(page_size=self.page_size, token_budget=self.token_budget, sink_pages=self.attrs.sink_pages,
                    recent_pages=self.attrs.recent_pages, sub_page_size=self.attrs.sub_page_size,
                    dense_layers=self.dense_layers, group_reduce=self.attrs.group_reduce,
                    candidate_share=self.attrs.candidate_share)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _capture(self, token_ids):
        torch = self.torch
        handles = [a.register_forward_pre_hook(self._hook, with_kwargs=True) for a in self._attn]
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([list(token_ids)]), use_cache=True)
        finally:
            for hd in handles:
                hd.remove()
        qkv = [self._captured.pop(i) for i in range(self.num_layers)]
        return [np.stack(x) for x in zip(*qkv)], out

    def observe(self, token_ids: Sequence[int]) -> Observation:
        (q, k, v), _ = self._capture(token_ids)
        T = len(token_ids)
        positions = range(max(1, T - self.decode_steps), T)
        sel = replay_selection(q, k, positions, self.page_size, self.token_budget, self.attrs,
                               self.dense_layers)
        return Observation(keys=k, values=v, selected_pages=sel)

    def next_token_logits(self, token_ids: Sequence[int], transform: KVTransform | None = None) -> np.ndarray:
        return self.next_token_logits_many(token_ids, [transform])[0]

    def next_token_logits_many(self, token_ids: Sequence[int],
                               transforms: Sequence[KVTransform | None]) -> list[np.ndarray]:
        """The prefix's K/V captured once; one decode step of the last token per transform."""
        torch = self.torch
        from transformers import DynamicCache  # noqa: PLC0415

        (_, k, v), _ = self._capture(token_ids[:-1])
        T = len(token_ids)
        out_logits = []
        for transform in transforms:
            layers = []
            for layer in range(self.num_layers):
                kl, vl = (k[layer], v[layer]) if transform is None else transform(layer, k[layer], v[layer])
                layers.append((torch.from_numpy(np.ascontiguousarray(kl, np.float32))[None],
                               torch.from_numpy(np.ascontiguousarray(vl, np.float32))[None]))
            cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
            with torch.no_grad():
                out = self.model(torch.tensor([[token_ids[-1]]]), position_ids=torch.tensor([[T - 1]]),
                                 use_cache=True, **{self._cache_kwarg: cache})
            out_logits.append(out.logits[0, -1].double().numpy())
        return out_logits


register_source("hf")(HFSource)
