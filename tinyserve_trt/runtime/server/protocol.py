"""The OpenAI request bodies the server accepts, and their mapping to SamplingParams.

Unknown fields are rejected (as OpenAI does). Fields the engine cannot honour are
accepted only at their neutral value: ``presence_penalty`` / ``frequency_penalty``
0, empty ``logit_bias``, ``best_of == n``, no ``echo`` / ``suffix``, no tools,
``response_format`` text. Extensions (vLLM's names): ``top_k``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids`` and ``token_budget``
(the Quest decode budget of this request; 0 = dense).

Numeric bounds that need no package (finite floats, int32-safe ints, ``n`` at
most ``MAX_N``) are declared on the fields too, so the OpenAPI schema states them
and a fuzzer generates mostly admissible bodies; ``SamplingParams`` checks them
again for the other entry points. Sampling fields left out take the package's
defaults (``generation_defaults.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyserve_trt.runtime.limits import INT32_MAX, MAX_N, SEED_MAX
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.server.errors import bad_request, from_value_error

MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON's Infinity / 1e999: a 400

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: Int32 | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    token_budget: Int32 | None = None

    def _unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported (only 0); repetition_penalty (extension) "
                                  f"is the penalty this server implements", param=name, code="unsupported")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias", code="unsupported")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: SamplingParams) -> SamplingParams:
        """SamplingParams for one prompt: the fields given here over ``defaults`` (the
        package's); APIError(400) naming the bad field."""
        self._unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                     repetition_penalty=self.repetition_penalty)
        try:
            return replace(defaults, **{k: v for k, v in given.items() if v is not None},
                           seed=self.seed, stop=stop, stop_token_ids=self.stop_token_ids or (),
                           ignore_eos=self.ignore_eos, max_tokens=max_tokens, n=self.n, logprobs=logprobs,
                           token_budget=self.token_budget)
        except ValueError as e:
            raise from_value_error(e) from None


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids or lists of them."""

    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check(self) -> None:
        if self.echo:
            raise bad_request("echo is not supported", param="echo", code="unsupported")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix", code="unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (no server-side ranking)", param="best_of", code="unsupported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        if isinstance(self.prompt, list) and (not self.prompt or any(p in ("", []) for p in self.prompt)):
            raise bad_request("prompt must not be empty", param="prompt")
        if self.prompt == "":
            raise bad_request("prompt must not be empty", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, ... : harmless, dropped
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise bad_request("only text content parts are supported", param="messages", code="unsupported")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: rendered with the package's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def check(self) -> None:
        if self.tools:
            raise bad_request("tools are not supported", param="tools", code="unsupported")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported", param="tool_choice", code="unsupported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported", param="response_format",
                              code="unsupported")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict]:
        """[{"role", "content"}] for the chat template (``developer`` is a ``system`` turn)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate ``body`` into ``model``; APIError(400) naming the first bad field."""
    from pydantic import ValidationError

    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
        param = loc[0] if loc else None
        if err.get("type") == "extra_forbidden":
            raise bad_request(f"unrecognized request argument: {'.'.join(loc)}", param=param) from None
        raise bad_request(f"{'.'.join(loc) or 'body'}: {err.get('msg')}", param=param) from None
