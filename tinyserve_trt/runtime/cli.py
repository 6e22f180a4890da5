"""``tinyserve``: the runtime's command line.

    tinyserve generate MODEL_DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N]
                       [--temperature T] [--dense | --token-budget N] [--sparse-min-ratio R] [--json]
                       [--require-native]
                       [--kv-cache-dir DIR [--kv-cache-max-gb N]] [--kv-cache-host-gb N]
    tinyserve serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--max-queue N] [--timeout S]
                    [--served-model-name NAME] [--api-key-file PATH] [--allowed-host HOST]... [--warmup FILE]
                    [--replicas N [--ray-address ADDR] [--routing prefix|default]] [engine options]

With ``--json`` stdout holds exactly one JSON object:
``{"token_ids": [generated only], "text": "...", "stats": {"request": ..., "engine": ...}}``.
``serve`` runs the OpenAI-compatible server (needs the ``serve`` extra) until interrupted;
with ``--replicas N`` (N > 1) or ``--ray-address``, N engine replicas on Ray Serve behind
the same API (needs the ``scale`` extra; see docs/scale_out.md).
Both log the engine's kernel report (graph, decode kernel, cold format, why: ``generate``
ends its text output with it, ``--json`` has it in ``stats.engine.kernel_*``); with
``--require-native`` a fallback from the native kernel is an error (exit 2, one line).
Bad input: one line on stderr, exit status 2. ``serve`` exits 3 when its engine
failed beyond recovery (so a supervisor restarts it).
Defaults come from SamplingParams, EngineConfig and ServerConfig; sampling flags
left out take the package's generation config (greedy when it has none).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tinyserve_trt.runtime.config import ORT_PROVIDERS, EngineConfig
from tinyserve_trt.runtime.limits import MAX_N
from tinyserve_trt.runtime.sampling import SamplingParams

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    sp, ec = SamplingParams(), EngineConfig()
    parser = _Parser(prog="tinyserve", description="Serve tinyserve model packages (ONNX Runtime / TensorRT).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("model_dir", metavar="MODEL_DIR", help="package written by tinyserve-export")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the package's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn in the chat template")
    g.add_argument("--max-tokens", type=int, default=sp.max_tokens)
    pkg_default = "default: the package's generation config; greedy without one"
    g.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({pkg_default})")
    g.add_argument("--top-p", type=float, default=None, help=f"({pkg_default})")
    g.add_argument("--top-k", type=int, default=None, help=f"0 = off ({pkg_default})")
    g.add_argument("--repetition-penalty", type=float, default=None, help=f"1 = off ({pkg_default})")
    g.add_argument("--seed", type=int, default=sp.seed)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    _engine_options(g, ec)
    g.add_argument("--json", action="store_true", help="print one JSON object")

    from tinyserve_trt.runtime.server.config import ServerConfig  # no fastapi import: config only

    sc = ServerConfig()
    s = sub.add_parser("serve", help="serve a package over an OpenAI-compatible HTTP API")
    s.add_argument("model_dir", metavar="MODEL_DIR", help="package written by tinyserve-export")
    s.add_argument("--host", default=sc.host, help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=sc.port)
    s.add_argument("--served-model-name", default=sc.model_name,
                   help="the model id clients send (default: the package directory's name)")
    s.add_argument("--max-queue", type=int, default=sc.max_queue,
                   help="requests that may wait beyond --max-batch running ones; more get 429")
    s.add_argument("--timeout", type=float, default=sc.timeout,
                   help="seconds a request may take before it is aborted and answered 504 (0: no limit)")
    s.add_argument("--max-n", type=int, default=sc.max_n,
                   help=f"most samples per prompt (n) a request may ask for (at most {MAX_N})")
    s.add_argument("--max-batch", type=int, default=ec.max_batch)
    s.add_argument("--max-tokens-per-step", type=int, default=ec.max_tokens_per_step)
    s.add_argument("--prefill-chunk", type=int, default=ec.prefill_chunk)
    s.add_argument("--max-seq-len", type=int, default=ec.max_seq_len)
    s.add_argument("--memory", type=_memory, default=ec.memory,
                   help="KV pool: bytes (int) or a fraction of RAM (0 < f <= 1)")
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", metavar="PATH", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health, KEY being this "
                          "file's content (one line; keep the file mode 600)")
    key.add_argument("--api-key", default=None,
                     help="the key itself: visible to every local user in the process list, so prefer "
                          "--api-key-file or the TINYSERVE_API_KEY environment variable (the default; "
                          "none of the three = no authentication)")
    s.add_argument("--allowed-host", action="append", default=list(sc.allowed_hosts), metavar="HOST",
                   help="also answer requests whose Host header names HOST (repeatable; a name, an IP, "
                        "'*.suffix', or '*' for any): loopback names and a non-wildcard --host are always "
                        "allowed, other Hosts get 421 (DNS rebinding)")
    s.add_argument("--warmup", metavar="FILE", default=None,
                   help="prefill these prompts into the prefix cache at start: one per line, or JSON Lines "
                        "of {\"prompt\": ...} / {\"messages\": [...]}")
    from tinyserve_trt.runtime.server.ray_app import ScaleConfig  # no ray import: config only

    rc = ScaleConfig()
    s.add_argument("--replicas", type=int, default=1,
                   help="engine replicas on Ray Serve (N > 1; needs the scale extra), one process each")
    s.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of starting a local one")
    s.add_argument("--routing", choices=("prefix", "default"), default=rc.routing,
                   help="replicas: prefix-aware (the owner of the prompt's first pages) or Ray Serve's default")
    s.add_argument("--route-pages", type=int, default=rc.route_pages,
                   help="replicas: leading full pages whose hash picks the replica")
    s.add_argument("--replica-cpus", type=float, default=rc.replica_cpus, help="replicas: CPUs reserved per replica")
    s.add_argument("--replica-gpus", type=float, default=rc.replica_gpus, help="replicas: GPUs reserved per replica")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _engine_options(s, ec)
    from tinyserve_trt.runtime.eval.cli import add_parser as add_eval

    add_eval(sub)
    return parser


def _engine_options(p: argparse.ArgumentParser, ec: EngineConfig) -> None:
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--dense", action="store_true", help="attend every page (no sparse selection)")
    budget.add_argument("--token-budget", type=int, default=ec.token_budget,
                        help="decode token budget (default: the package's)")
    p.add_argument("--sparse-min-ratio", type=float, default=ec.sparse_min_ratio,
                   help="decode dense while a sequence's context is below this many times its token "
                        "budget (0: sparse whenever the budget is below the context; default %(default)s)")
    p.add_argument("--backend", default=ec.backend)
    p.add_argument("--threads", type=int, default=ec.threads)
    p.add_argument("--no-prefix-sharing", action="store_true")
    p.add_argument("--hot-fraction", type=float, default=ec.hot_fraction,
                   help="share of KV pages kept hot (FP) when the package has an INT8 cold tier "
                        "(default: the calibrated value; 1.0 never demotes)")
    p.add_argument("--no-kv-tiers", action="store_true", help="keep every KV page hot (ignore the cold tier)")
    p.add_argument("--kv-scales", choices=("dynamic", "static"), default=ec.kv_scales,
                   help="INT8 scales of cold pages: each page's own range, or the calibration's (static)")
    p.add_argument("--kv-cache-dir", metavar="DIR", default=ec.kv_cache_dir,
                   help="keep KV pages of prompt prefixes the pool evicts (and, at exit, the cached ones) in "
                        "this directory and reuse them: across requests, restarts, and replicas given the same DIR")
    p.add_argument("--kv-cache-max-gb", type=float, default=ec.kv_cache_max_gb,
                   help="most GiB --kv-cache-dir holds; past it the least reused pages go (default %(default)s)")
    p.add_argument("--kv-cache-host-gb", type=float, default=ec.kv_cache_host_gb,
                   help="GiB of host memory for evicted KV pages before they go to --kv-cache-dir (0: none; "
                        "alone: a memory-only store)")
    p.add_argument("--kv-cache-write-through", action="store_true",
                   help="store every prefix page as soon as it is computed, not only when evicted (on by "
                        "default with --replicas: a replica then reuses what another just computed)")
    p.add_argument("--ort-provider", choices=ORT_PROVIDERS, default=ec.ort_provider,
                   help="ONNX Runtime EP (backend ort): cuda/tensorrt keep the KV pages on the GPU "
                        "(docs/gpu_paths.md); auto = cuda when onnxruntime-gpu and torch see a GPU")
    p.add_argument("--native-arch", default=ec.native_arch, metavar="TARGET",
                   help="-march of the native CPU kernel's build (default: native; e.g. x86-64-v2)")
    p.add_argument("--plugin-dir", default=ec.plugin_dir, metavar="DIR",
                   help="where tinyserve-build-plugin -o DIR put the GPU libraries (default: its cache)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="backend trt: no CUDA graphs for decode steps")
    p.add_argument("--require-native", action="store_true", default=ec.require_native,
                   help="exit 2 unless the op decodes on a native kernel (the C++ CPU node or the TensorRT "
                        "plugin) instead of falling back to its ONNX function (the kernel report says which)")


def _kernel_options(args) -> dict:
    """The EngineConfig fields of the kernel flags (what runs the op, and where its libraries are)."""
    return dict(require_native=args.require_native, native_arch=args.native_arch, plugin_dir=args.plugin_dir,
                cuda_graphs=not args.no_cuda_graphs)


def _kv_cache(args) -> dict:
    """The page-store options of ``--kv-cache-*`` (EngineConfig validates them)."""
    return dict(kv_cache_dir=args.kv_cache_dir, kv_cache_max_gb=args.kv_cache_max_gb,
                kv_cache_host_gb=args.kv_cache_host_gb, kv_cache_write_through=args.kv_cache_write_through)


def _memory(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (int) or a RAM fraction, got {text!r}") from None


def _generate(args) -> int:
    from tinyserve_trt.runtime.generation_defaults import default_params
    from tinyserve_trt.runtime.llm import LLM
    from tinyserve_trt.runtime.model_package import ModelPackage

    package = ModelPackage.load(args.model_dir)
    params = default_params(package.path, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos, max_tokens=args.max_tokens)
    llm = LLM(package, backend=args.backend, dense=args.dense, token_budget=args.token_budget,
              sparse_min_ratio=args.sparse_min_ratio,
              threads=args.threads, prefix_sharing=not args.no_prefix_sharing, max_batch=1,
              hot_fraction=args.hot_fraction, kv_tiers=not args.no_kv_tiers, kv_scales=args.kv_scales,
              ort_provider=args.ort_provider, **_kernel_options(args), **_kv_cache(args))
    if args.chat:
        if args.prompt is None:
            raise ValueError("--chat needs --prompt")
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    elif args.prompt is not None:
        (out,) = llm.generate([args.prompt], params)
    else:
        (out,) = llm.generate(prompt_token_ids=[args.prompt_ids], params=params)
    completion = out.outputs[0]
    if args.json:
        stats = {"request": out.stats.as_dict() if out.stats else {}, "engine": llm.stats(),
                 "finish_reason": completion.finish_reason}
        print(json.dumps({"token_ids": completion.token_ids, "text": completion.text, "stats": stats}))
    else:
        print(completion.text if completion.text else " ".join(map(str, completion.token_ids)))
        s = out.stats
        if s is not None and s.ttft is not None:
            rate = f", {s.tokens_per_s:.1f} tok/s" if s.tokens_per_s else ""
            print(f"[{s.output_tokens} tokens, ttft {s.ttft * 1e3:.1f} ms{rate}]", file=sys.stderr)
        from tinyserve_trt.runtime.memory_report import memory_line

        print(f"[{memory_line(llm.engine)}]", file=sys.stderr)
        report = llm.engine.kernel_report
        if report is not None and not report.fallback:  # a fallback was logged as a warning at start
            print(f"[{report.line()}]", file=sys.stderr)
    llm.close()
    return 0


def _server_config(args):
    """The ServerConfig of ``serve``'s flags (ValueError for a bad one). The API key comes from
    ``--api-key-file``, else ``--api-key``, else ``TINYSERVE_API_KEY``."""
    import os
    from pathlib import Path

    from tinyserve_trt.runtime.server.config import ServerConfig

    if args.api_key_file is not None:
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({type(e).__name__})") from None
        if not api_key.strip():
            raise ValueError(f"--api-key-file {args.api_key_file}: the file is empty")
    elif args.api_key is not None:
        api_key = args.api_key
    else:
        api_key = os.environ.get("TINYSERVE_API_KEY") or None
    return ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name,
                        max_queue=args.max_queue, timeout=args.timeout or None, max_n=args.max_n,
                        api_key=api_key, allowed_hosts=tuple(args.allowed_host))


def _serve(args) -> int:
    import os
    import stat

    config = _server_config(args)
    if args.api_key is not None:
        print("tinyserve: warning: --api-key is visible to every local user (ps); use --api-key-file or "
              "TINYSERVE_API_KEY", file=sys.stderr, flush=True)
    if args.api_key_file is not None and os.stat(args.api_key_file).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"tinyserve: warning: {args.api_key_file} is readable by other users; chmod 600 it",
              file=sys.stderr, flush=True)
    engine = dict(backend=args.backend, dense=args.dense, token_budget=args.token_budget,
                  sparse_min_ratio=args.sparse_min_ratio, threads=args.threads,
                  prefix_sharing=not args.no_prefix_sharing, max_batch=args.max_batch,
                  max_tokens_per_step=args.max_tokens_per_step, prefill_chunk=args.prefill_chunk,
                  max_seq_len=args.max_seq_len, memory=args.memory, hot_fraction=args.hot_fraction,
                  kv_tiers=not args.no_kv_tiers, kv_scales=args.kv_scales, ort_provider=args.ort_provider,
                  **_kernel_options(args), **_kv_cache(args))
    if (args.replicas != 1 or args.ray_address is not None) and args.kv_cache_dir is not None:
        engine["kv_cache_write_through"] = True  # replicas share the directory: publish pages at once
    EngineConfig(**engine)  # bad options: one line and exit 2 before anything loads
    from tinyserve_trt.runtime.server.warmup import load_warmup

    warmup = load_warmup(args.warmup) if args.warmup is not None else ()
    if args.replicas != 1 or args.ray_address is not None:
        from tinyserve_trt.runtime.server.ray_app import ScaleConfig

        scale = ScaleConfig(replicas=args.replicas, ray_address=args.ray_address, routing=args.routing,
                            route_pages=args.route_pages, replica_cpus=args.replica_cpus,
                            replica_gpus=args.replica_gpus)
        try:
            from tinyserve_trt.runtime.server.ray_app import run
            import ray.serve  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"--replicas needs the scale extra: pip install 'tinyserve-trt[scale]' ({e})") from None
        return run(args.model_dir, config, scale, engine, warmup)
    try:
        from tinyserve_trt.runtime.server.app import serve
    except ImportError as e:
        raise RuntimeError(f"serve needs the serve extra: pip install 'tinyserve-trt[serve]' ({e})") from None
    return serve(args.model_dir, config, log_level=args.log_level, warmup=warmup, **engine)


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (not the one at creation: tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _log_to_stderr(level: str) -> None:
    """``tinyserve.*`` records at ``level`` and above on stderr, one line each (the engine's kernel
    report, the server's warm-up); once per process."""
    logger, level = logging.getLogger("tinyserve"), getattr(logging, level.upper())
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("tinyserve: %(message)s"))
        logger.addHandler(handler)
    handler.setLevel(level)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # generate: warnings only (stdout/stderr stay what they were; the report ends the text output)
    _log_to_stderr(args.log_level if args.command == "serve" else "warning")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "eval":
            from tinyserve_trt.runtime.eval.cli import run as run_eval

            return run_eval(args)
    except (ValueError, RuntimeError, OSError) as e:  # PackageError is a ValueError
        msg = " ".join(str(e).split())
        print(f"tinyserve: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
