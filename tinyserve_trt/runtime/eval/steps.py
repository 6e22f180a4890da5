"""Run a set of requests that share a prompt prefix: the first prefills it, the rest reuse its pages."""

from __future__ import annotations


def run_requests(engine, requests: dict, progress=None) -> dict:
    """``requests``: request id -> (prompt ids, SamplingParams). The first request runs alone until
    its prompt is prefilled (its full pages enter the prefix cache); the others are added then and
    all decode together. Returns request id -> output token ids. ``progress(done, total)``: steps."""
    items = list(requests.items())
    first_id, (first_prompt, first_params) = items[0]
    chunk = engine.config.prefill_chunk
    total = -(-len(first_prompt) // chunk) + max(p.max_tokens for _, p in requests.values()) + len(items)
    outputs, done_steps = {}, 0
    seqs = {first_id: engine.add_request(first_id, first_prompt, first_params)}

    def step():
        nonlocal done_steps
        for seq in engine.step():
            if seq.error is not None:
                raise RuntimeError(f"request {seq.request_id} failed: {seq.error}")
        done_steps += 1
        if progress:
            progress(min(done_steps, total), total)

    while seqs[first_id].num_output_tokens == 0 and not seqs[first_id].is_finished:
        step()
    for rid, (prompt, params) in items[1:]:
        seqs[rid] = engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        step()
    for rid, seq in seqs.items():
        outputs[rid] = list(seq.output_token_ids)
    if progress:
        progress(total, total)
    return outputs
