"""Quality of a package's sparse attention, measured through its own runtime (issue #31).

``tinyserve eval PKG``: teacher-forced perplexity of a text's last positions at each token
budget against dense (``perplexity.py``) and passkey retrieval at chosen depths
(``passkey.py``), both run by the package's Engine - the same op, pages, scheduler and
backend that serve it - with the engine's sampler wrapped to feed given tokens
(``forcing.py``). One prefill per prompt is shared by every budget through the prefix cache.
"""
