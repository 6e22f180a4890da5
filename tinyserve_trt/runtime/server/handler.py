"""CompletionHandler: one OpenAI request from body to answer, for both endpoints.

read the body within its limits (415, 400, 408) and validate (400) -> admit its
sequences, prompts x n (429) -> refuse a text prompt longer in characters than the
context can hold in tokens (cheap, before any tokenizing) -> render the chat template and
tokenize in a worker process under time and size limits (``render.Renderer``: never on
the event loop) and check the context and the package's bounds -> generate on the
shared AsyncLLM -> one JSON body, or a server-sent-events stream. Every
request that reaches here is counted in the metrics once, with its final status.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tinyserve_trt.runtime.async_llm import AsyncLLM
from tinyserve_trt.runtime.engine import StepFailed
from tinyserve_trt.runtime.limits import check_against_package
from tinyserve_trt.runtime.server.admission import Admission
from tinyserve_trt.runtime.server.body import read_json
from tinyserve_trt.runtime.server.config import ServerConfig
from tinyserve_trt.runtime.server.errors import APIError, bad_request, error_body, from_value_error
from tinyserve_trt.runtime.server.generation import ClientGone, RequestTimeout, outputs, until_done_or_gone
from tinyserve_trt.runtime.server.metrics import ServerMetrics
from tinyserve_trt.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, parse
from tinyserve_trt.runtime.server.render import RenderError, Renderer, longest_token_chars
from tinyserve_trt.runtime.server.responses import Responder, usage
from tinyserve_trt.runtime.server.sse import EventStream

ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
ENGINE_UNAVAILABLE = "the engine is not running (it stopped or is shutting down); retry later"
log = logging.getLogger("tinyserve.server")


def step_failed(rid: str, e: StepFailed) -> APIError:
    """The 500 of a request whose engine step raised: the cause's class for the client, the
    cause itself (``repr``, traceback) for the log - never the other way round."""
    log.error("request %s: engine step failed: %r", rid, e.cause)
    return APIError(500, f"the engine step running this request failed ({type(e.cause).__name__}); the request "
                         f"was aborted", code="engine_step_failed")


def engine_unavailable(rid: str, e: RuntimeError) -> APIError:
    log.error("request %s: the engine is unavailable: %s", rid, e)
    return APIError(503, ENGINE_UNAVAILABLE, code="engine_unavailable")


class _Timing:
    """Server-side TTFT / per-token latency / end-to-end latency of one request."""

    def __init__(self, arrival: float):
        self.arrival, self.first, self.last, self.tokens = arrival, None, None, 0

    def note(self, now: float, out) -> None:
        n = max((len(o.token_ids) for o in out.outputs), default=0)
        if n and self.first is None:
            self.first = now
        if n > self.tokens:
            self.tokens, self.last = n, now


class CompletionHandler:
    def __init__(self, llm: AsyncLLM, config: ServerConfig, model_name: str, metrics: ServerMetrics,
                 admission: Admission, renderer: Renderer):
        self.llm, self.config, self.model_name = llm, config, model_name
        self.metrics, self.admission, self.renderer = metrics, admission, renderer
        engine = llm.engine
        pool_tokens = engine.pool.num_pages * engine.pool.page_size
        self.context = min(engine.config.max_seq_len or llm.package.max_context, pool_tokens)
        self.vocab = llm.package.vocab_size
        # a text of more characters than this has more tokens than the context holds
        self.chars_per_token = longest_token_chars(llm.package)  # None: no tokenizer
        self.max_chars = self.context * (self.chars_per_token or 1)

    # ---- entry -----------------------------------------------------------------------
    async def __call__(self, request: Request, kind: str) -> Response:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        endpoint = ENDPOINTS[kind]
        try:
            req = await self._parse(request, kind)
            sequences = len(req.prompts() if isinstance(req, CompletionRequest) else [0]) * req.n
            self.admission.acquire(sequences)
        except APIError as e:
            self.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
            return e.response()
        try:  # admitted first: the renders waiting for a worker are bounded by admission
            prompts, params = await self._prepare(req, kind)
        except BaseException as e:
            self.admission.release(sequences)
            if not isinstance(e, APIError):
                raise
            self.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
            return e.response()
        deadline = None if self.config.timeout is None else arrival + self.config.timeout
        responder = Responder(kind, self.model_name, self._token_text, params.logprobs is not None)
        rid = responder.id
        if req.stream:
            outcome = {"status": 499}  # until the stream says otherwise: the client left

            def closed():
                self.admission.release(sequences)
                self.metrics.requests.inc(endpoint=endpoint, status=str(outcome["status"]))

            events = self._events(req, responder, prompts, params, rid, deadline, _Timing(arrival), outcome)
            return EventStream(events, on_close=closed)
        status = 500
        try:
            body = await until_done_or_gone(self._collect(req, responder, prompts, params, rid, deadline,
                                                          _Timing(arrival)), request.receive)
            status = 200
            return JSONResponse(body)
        except APIError as e:
            status = e.status
            return e.response()
        except ClientGone:
            status = 499
            return Response(status_code=499)
        finally:
            self.admission.release(sequences)
            self.metrics.requests.inc(endpoint=endpoint, status=str(status))

    # ---- validation ------------------------------------------------------------------
    async def _parse(self, request: Request, kind: str):
        """The validated request (no tokenizing yet): body limits, model, fields, n, prompts."""
        cfg = self.config
        body = await read_json(request, cfg.max_body_bytes, cfg.max_json_depth, cfg.body_timeout_s)
        req = parse(CompletionRequest if kind == "completion" else ChatCompletionRequest, body)
        if req.model != self.model_name:
            raise APIError(400, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        req.check()
        if req.n > cfg.max_n:
            raise bad_request(f"n must be <= {cfg.max_n} (this server's limit), got {req.n}", param="n")
        if isinstance(req, CompletionRequest) and len(req.prompts()) > cfg.max_prompts:
            raise bad_request(f"prompt must hold at most {cfg.max_prompts} prompts (this server's limit), got "
                              f"{len(req.prompts())}", param="prompt")
        return req

    async def _prepare(self, req, kind: str):
        """Prompt token ids and SamplingParams of an admitted request."""
        prompts = await self._prompt_ids(req)
        longest = max(len(p) for p in prompts)
        if longest >= self.context:
            raise bad_request(f"this model's maximum context length is {self.context} tokens; the prompt has "
                              f"{longest}", param="messages" if kind == "chat" else "prompt",
                              code="context_length_exceeded")
        if isinstance(req, CompletionRequest):
            max_tokens, logprobs = req.max_tokens, req.logprobs
        else:
            max_tokens, logprobs = req.requested_max_tokens, req.requested_logprobs
        max_tokens = self.context - longest if max_tokens is None else max_tokens
        if longest + max_tokens > self.context and max_tokens >= 1:
            raise bad_request(f"this model's maximum context length is {self.context} tokens; you requested "
                              f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} for the "
                              f"completion)", param="max_tokens", code="context_length_exceeded")
        params = req.sampling_params(max_tokens, logprobs, self.llm.default_params)
        try:
            check_against_package(params, self.llm.package)
        except ValueError as e:
            raise from_value_error(e) from None
        return prompts, params

    async def _prompt_ids(self, req) -> list[list[int]]:
        """Token ids of each prompt; text is rendered / tokenized by ``self.renderer``."""
        chat = isinstance(req, ChatCompletionRequest)
        param = "messages" if chat else "prompt"
        texts = [] if chat else [p for p in req.prompts() if isinstance(p, str)]
        if (chat or texts) and self.chars_per_token is None:
            raise bad_request("this model has no tokenizer: send prompt token ids instead of text", param=param,
                              code="unsupported")
        # the cheap bound first: more characters than the context holds tokens is refused here,
        # not after seconds of tokenizing (a token covers at most chars_per_token characters)
        for p in req.prompts() if not chat else ():
            size = len(p)
            if (size > self.max_chars) if isinstance(p, str) else (size >= self.context):
                unit = "characters, more than that holds" if isinstance(p, str) else "tokens"
                raise bad_request(f"this model's maximum context length is {self.context} tokens; the prompt has "
                                  f"{size} {unit}", param=param, code="context_length_exceeded")
        if chat and self.llm.package.chat_template is None:
            raise bad_request("this model has no chat template: use /v1/completions", param=param,
                              code="unsupported")
        try:
            if chat:
                return [await self.renderer.chat(req.chat_messages(), self.max_chars, self.context)]
            encoded = iter(await self.renderer.encode(texts, self.max_chars, self.context) if texts else ())
        except RenderError as e:
            raise self._render_error(e, param) from None
        out = []
        for p in req.prompts():
            ids = next(encoded) if isinstance(p, str) else p
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise bad_request(f"prompt token ids must be in [0, {self.vocab}), got {bad[:5]}", param="prompt")
            if not ids:
                raise bad_request("the prompt has no tokens", param="prompt")
            out.append(ids)
        return out

    def _render_error(self, e: RenderError, param: str) -> APIError:
        """The one-line answer to a prompt the render worker refused (``render.RenderError``)."""
        what = "rendering the chat template" if param == "messages" else "tokenizing the prompt"
        if e.kind == "too_long":
            size = f"{e.tokens} tokens" if e.tokens is not None else f"{e.chars} characters, more than that holds"
            return bad_request(f"this model's maximum context length is {self.context} tokens; the prompt has "
                               f"{size}", param=param, code="context_length_exceeded")
        if e.kind == "timeout":
            return bad_request(f"{what} {e.message}", param=param, code="render_timeout")
        if e.kind == "memory":
            return bad_request(f"{what} {e.message}", param=param, code="render_memory")
        if e.kind == "template":  # the template's raise_exception, or a render error
            return bad_request(f"the chat template failed on these messages: {e.message}", param=param)
        if e.kind == "tokenizer":
            return bad_request(f"{e.message} on this prompt", param=param, code="render_failed")
        if e.kind == "start":
            log.error("the render worker could not start: %s", e.message)
            return APIError(503, "the server cannot tokenize text now; retry later", code="render_unavailable")
        log.warning("%s failed: %s: %s", what, e.kind, e.message)  # "package" names the package's path
        if e.kind == "package":
            return bad_request("this model cannot render or tokenize text", param=param, code="unsupported")
        return bad_request(f"{what} failed: the render worker exited", param=param, code="render_failed")

    def _token_text(self, token_id: int) -> str:
        return self.llm.package.decode([token_id], skip_special_tokens=False)

    # ---- answering -------------------------------------------------------------------
    def _observe(self, timing: _Timing, usage_: dict) -> None:
        m = self.metrics
        m.prompt_tokens.inc(usage_["prompt_tokens"])
        m.generation_tokens.inc(usage_["completion_tokens"])
        if timing.first is not None:
            m.ttft.observe(timing.first - timing.arrival)
            m.e2e.observe(timing.last - timing.arrival)
            if timing.tokens > 1:
                m.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))

    async def _collect(self, req, responder, prompts, params, rid, deadline, timing) -> dict:
        loop = asyncio.get_running_loop()
        final = {}
        try:
            async with aclosing(outputs(self.llm, prompts, params, rid, deadline)) as stream:
                async for i, out in stream:
                    timing.note(loop.time(), out)
                    final[i] = out
        except RequestTimeout:
            raise APIError(504, f"the request did not finish within the server's {self.config.timeout} s timeout",
                           code="timeout") from None
        except ValueError as e:
            raise from_value_error(e) from None
        except StepFailed as e:  # this request's step failed; the engine goes on serving
            raise step_failed(rid, e) from None
        except RuntimeError as e:
            raise engine_unavailable(rid, e) from None
        n = params.n
        choices = [responder.choice(i * n + o.index, o) for i, out in final.items() for o in out.outputs]
        use = usage(sum(map(len, prompts)), sum(len(o.token_ids) for out in final.values() for o in out.outputs))
        self._observe(timing, use)
        return responder.body(choices, use)

    async def _events(self, req, responder, prompts, params, rid, deadline, timing, outcome: dict):
        """The stream's payloads; an error after the headers went out is sent as an error
        event (the openai client raises it), then ``[DONE]``. Sets ``outcome["status"]``."""
        loop = asyncio.get_running_loop()
        n, finished, completion_tokens = params.n, set(), 0
        if responder.kind == "chat":
            for index in range(len(prompts) * n):
                yield json.dumps(responder.role_chunk(index))
        try:
            # aclosing: when the client leaves, the prompts are aborted now, not when GC finds them
            async with aclosing(outputs(self.llm, prompts, params, rid, deadline)) as stream:
                async for i, out in stream:
                    timing.note(loop.time(), out)
                    for o in out.outputs:
                        index = i * n + o.index
                        done = o.finish_reason is not None and index not in finished
                        if done:
                            finished.add(index)
                            completion_tokens += len(o.token_ids)
                        # tokens whose text is held back (a possible stop string, a partial
                        # character) only make a chunk when their logprobs were asked for
                        if o.delta_text or done or (responder.want_logprobs and o.delta_token_ids):
                            yield json.dumps(responder.delta_chunk(index, o, o.finish_reason if done else None))
        except RequestTimeout:
            outcome["status"] = 504
            yield json.dumps(error_body(504, f"the request did not finish within the server's "
                                             f"{self.config.timeout} s timeout", code="timeout"))
        except ValueError as e:
            outcome["status"] = 400
            yield json.dumps(from_value_error(e).body())
        except StepFailed as e:
            outcome["status"] = 500
            yield json.dumps(step_failed(rid, e).body())
        except RuntimeError as e:
            outcome["status"] = 503
            yield json.dumps(engine_unavailable(rid, e).body())
        else:
            use = usage(sum(map(len, prompts)), completion_tokens)
            self._observe(timing, use)
            if req.include_usage:
                yield json.dumps(responder.usage_chunk(use))
            outcome["status"] = 200
        yield "[DONE]"
