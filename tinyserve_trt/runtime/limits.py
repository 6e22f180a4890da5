"""Request limits: the bounds every entry point (HTTP API, ``LLM``, CLI) shares.

Two layers, so the three entry points cannot drift:

- package-free bounds (finite floats, int32-safe ints, ``n <= MAX_N``) are checked by
  ``SamplingParams.__post_init__`` with these constants;
- bounds that depend on the package (``token_budget`` within the context it is sized
  for, ``stop_token_ids`` inside the vocabulary) are checked by
  :func:`check_against_package`, which ``LLM``, ``AsyncLLM`` and the server call before a
  request is queued.

Every failure is a ``ValueError`` whose message starts with the field's name (the
server turns it into a 400 naming that ``param``; the CLI prints it on one line).
"""

from __future__ import annotations

import math

INT32_MAX = 2**31 - 1  # token counts, budgets and ids travel to the model as int32
SEED_MAX = 2**64 - 1  # numpy's SeedSequence takes any int >= 0; keep it one machine word
MAX_N = 128  # OpenAI's cap on samples per prompt; ServerConfig.max_n may lower it
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: held-back text is as long as the longest one
MAX_STOP_TOKEN_IDS = 1024


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_int(name: str, value, low: int, high: int = INT32_MAX, *, optional: bool = False) -> None:
    """ValueError unless ``value`` is an int in ``[low, high]`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not is_int(value) or not low <= value <= high:
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an int in [{low}, {high}]{none}, got {value!r}")


def check_against_package(params, package) -> None:
    """The bounds of ``params`` (SamplingParams) that depend on ``package`` (ModelPackage).

    ``token_budget`` must not exceed the context the package is sized for (a larger
    budget attends every page anyway: use 0 for dense); ``stop_token_ids`` must be
    token ids of its vocabulary. Does not look at the prompt (the engine checks it).
    """
    context = package.max_context
    if params.token_budget is not None and params.token_budget > context:
        raise ValueError(f"token_budget must be <= {context} (the context this package is sized for; 0 = dense), "
                         f"got {params.token_budget}")
    vocab = package.vocab_size
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[:5]}")


def check_engine_budget(token_budget: int | None, package) -> None:
    """An engine-wide ``token_budget`` (EngineConfig) within the package's context."""
    if token_budget is not None and token_budget > package.max_context:
        raise ValueError(f"token_budget must be <= {package.max_context} (the context this package is sized "
                         f"for; use --dense / dense=True to attend every page), got {token_budget}")
