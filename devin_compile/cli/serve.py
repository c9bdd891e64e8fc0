"""``devin-compile serve``: optimize a model and serve it with the OpenAI API over HTTP."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import common, ranks

HELP = "serve a model over HTTP with the OpenAI API (completions, chat, streaming, metrics)"
DESCRIPTION = ("Load SmolLM2-135M-Instruct (or --model PATH), optimize it, and serve it on http://HOST:PORT with "
               "the OpenAI API: /v1/completions, /v1/chat/completions (stream with server-sent events), /v1/models, "
               "/tokenize, /detokenize, /health, Prometheus /metrics and /openapi.json. --api-key (or DEVIN_API_KEY) "
               "requires a bearer key; the --max-* flags bound what one client may ask (413 past --max-body-bytes, "
               "a 400 naming the field past the others, 503 past --max-connections); an access-log line per request "
               "goes to stderr. Any optimize() option can be given with --option KEY=VALUE or in "
               "a JSON --config file; --speculative turns speculative decoding on (a request may turn it off or tune "
               "it with the extra body field \"speculative\"). SIGTERM or Ctrl-C stops accepting requests, lets those "
               "in flight finish for "
               "up to --shutdown-timeout seconds, aborts the rest and exits 0.")


def api_key(text: str) -> str:
    """An argparse type for --api-key; its error never repeats the key."""
    from ..serve.auth import check_key

    try:
        return check_key(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true/false, lists, objects)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. max_num_seqs=32)")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_optimize_arguments(p) -> None:
    common.add_model_arguments(p)
    p.add_argument("--config", metavar="FILE", help="a JSON file of optimize() options, e.g. "
                                                    '{"max_num_seqs": 32, "num_kv_blocks": 512}')
    p.add_argument("--option", action="append", type=option, default=[], metavar="KEY=VALUE",
                   help="an optimize() option (repeatable; overrides --config), e.g. --option max_num_seqs=32")
    p.add_argument("--max-num-seqs", type=common.int_at_least(1), metavar="N",
                   help="most sequences in one engine step (optimize's max_num_seqs; default 64)")
    p.add_argument("--max-model-len", type=common.int_at_least(2), metavar="N",
                   help="longest prompt + completion in tokens (default: the model's context)")
    p.add_argument("--num-kv-blocks", type=common.int_at_least(1), metavar="N",
                   help="KV-cache blocks in the pool (default: sized from free memory)")
    p.add_argument("--kv-cache-host-bytes", type=common.int_at_least(1), metavar="BYTES",
                   help="keep prefix KV blocks the pool evicts in a host-memory LRU tier of this many bytes")
    p.add_argument("--kv-cache-redis", metavar="URL",
                   help="share prefix KV blocks across replicas through Redis, e.g. redis://127.0.0.1:6379/0 "
                        "(the last tier, below --kv-cache-host-bytes); a prefix block goes there as soon as it "
                        "is computed")
    p.add_argument("--no-kv-cache-redis-write-through", dest="kv_cache_redis_write_through", action="store_false",
                   help="send Redis only the prefix blocks this process evicts, not every block it computes")
    common.add_speculative_arguments(p, "decode with speculative decoding by this method (a server request can "
                                        "turn it off or tune it with the extra body field \"speculative\")")
    common.add_quant_arguments(p)
    ranks.add_arguments(p)


def add_arguments(p) -> None:
    add_optimize_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=common.int_at_least(0), default=8000,
                   help="port to listen on (default 8000; 0 picks a free one, printed at start)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send (default: smollm2, or the --model folder/file name)")
    p.add_argument("--max-queue", type=common.int_at_least(1), metavar="N",
                   help="requests waiting for their first token before new ones get 429 (default: no limit)")
    p.add_argument("--shutdown-timeout", type=common.positive_float, default=30.0, metavar="S",
                   help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    add_front_door_arguments(p)
    p.add_argument("--no-metrics", action="store_true", help="turn off the Prometheus metrics (/metrics answers 404)")
    p.add_argument("--trace-file", metavar="FILE",
                   help="write an OpenTelemetry span per request to FILE as JSON lines (traces are also exported by "
                        "OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set; otherwise tracing is off)")
    p.add_argument("--trace-steps", action="store_true",
                   help="with tracing on: a child span per engine step under each request's span (step index, "
                        "batch size, prefill/decode tokens, drafted/accepted tokens); costs a span per request "
                        "per step")
    p.set_defaults(fn=main)


def add_front_door_arguments(p) -> None:
    """API keys, per-request limits and the access log (defaults safe for a public port)."""
    at_least_1 = common.int_at_least(1)
    p.add_argument("--api-key", action="append", type=api_key, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (repeatable: any "
                        "of the keys; default: the DEVIN_API_KEY variable, else no key); /health stays open")
    p.add_argument("--metrics-auth", action="store_true", help="/metrics needs the API key too (default: open)")
    p.add_argument("--max-body-bytes", type=at_least_1, default=1 << 20, metavar="N",
                   help="largest request body; larger ones get 413 (default 1048576)")
    p.add_argument("--max-prompt-tokens", type=at_least_1, default=8192, metavar="N",
                   help="most prompt tokens in one request, summed over its prompts (default 8192)")
    p.add_argument("--max-n", type=at_least_1, default=16, metavar="N", help="largest n a request may ask for "
                                                                            "(default 16)")
    p.add_argument("--max-tokens-limit", type=at_least_1, default=4096, metavar="N",
                   help="largest max_tokens a request may ask for, and the most a chat request without one gets "
                        "(default 4096)")
    p.add_argument("--max-connections", type=at_least_1, default=256, metavar="N",
                   help="most open connections; a request on one more gets 503 (default 256)")
    p.add_argument("--no-access-log", action="store_true",
                   help="no access-log line per request on stderr (method, path, status, tokens, latency)")


def server_options(args, environ=os.environ) -> dict:
    """The Server's keyword arguments for API keys, limits and logging (checked before any model loads)."""
    from ..serve.auth import keys_from
    from ..serve.limits import ServeLimits

    keys = keys_from(args.api_key, environ)
    if args.metrics_auth and not keys:
        raise ValueError("--metrics-auth needs an API key: give --api-key KEY or set DEVIN_API_KEY")
    limits = ServeLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                         max_n=args.max_n, max_tokens=args.max_tokens_limit, max_connections=args.max_connections)
    return dict(api_keys=keys, metrics_auth=args.metrics_auth, limits=limits, access_log=not args.no_access_log)


def show_access_log() -> None:
    """Access-log lines on stderr, as they are (no level or logger name)."""
    import logging

    from ..serve.access_log import LOGGER

    log = logging.getLogger(LOGGER)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def optimize_options(args) -> dict:
    """--config, then --option, then the named flags; checked (ValueError) before any model loads."""
    options: dict = {}
    if args.config is not None:
        if not os.path.isfile(args.config):
            raise FileNotFoundError(f"--config {args.config} is not a file")
        try:
            with open(args.config) as f:
                options = json.load(f)
        except ValueError as e:
            raise ValueError(f"--config {args.config} is not valid JSON: {e}") from None
        if not isinstance(options, dict):
            raise ValueError(f"--config {args.config} must hold a JSON object of optimize() options")
    options.update(dict(args.option))
    for flag in ("max_num_seqs", "max_model_len", "num_kv_blocks"):
        if getattr(args, flag) is not None:
            options[flag] = getattr(args, flag)
    tiers = []
    if args.kv_cache_host_bytes is not None:
        tiers.append({"backend": "host_lru", "max_bytes": args.kv_cache_host_bytes})
    if args.kv_cache_redis is not None:
        tiers.append({"backend": "redis", "url": args.kv_cache_redis,
                      "write_through": args.kv_cache_redis_write_through})
    if tiers:
        options["kv_cache_tiers"] = tiers
    if args.tensor_parallel > 1:
        options["tensor_parallel"] = args.tensor_parallel
    options = common.check_options(args, **common.quant_options(args, options))
    spec = common.speculative_config(args)  # after the check: a --draft-model path is loaded in main()
    if spec is not None:
        options["speculative"] = spec
    return options


def load_optimized(args, options: dict, con):
    """Load --model (and a --draft-model), then ``optimize()`` it with ``options``."""
    model, tok = common.load(args, con)
    if args.speculative is not None:
        common.load_draft(args, options["speculative"], con)
    return common.optimize(model, tok, con, **options)


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return "smollm2"
    return os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]


def main(args) -> int:
    options = optimize_options(args)
    front_door = server_options(args)
    from ..serve.server import exposure_warning
    from ..serve.tracing import OTLP_VARIABLES, make_tracing

    if args.trace_file is not None:
        folder = os.path.dirname(os.path.abspath(args.trace_file))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"--trace-file {args.trace_file}: folder {folder} does not exist")
    elif args.trace_steps and not any(os.environ.get(v) for v in OTLP_VARIABLES):
        raise ValueError("--trace-steps needs tracing on: give --trace-file FILE or set OTEL_EXPORTER_OTLP_ENDPOINT")
    launched = ranks.launch(args, stop_s=args.shutdown_timeout + 15)  # --tensor-parallel: spawn the ranks
    if launched is not None:
        return launched
    group = ranks.join(args, options.get("device"))
    opt = load_optimized(args, options, ranks.console(group))
    if group is not None and group.rank != 0:
        return ranks.follow(opt)  # rank 0 serves; this rank runs its steps
    from ..runtime.rank_watch import RankWatch
    from ..serve.app import Server
    from ..serve.server import serve

    tracing = make_tracing(args.trace_file, service_name=f"devin-compile {model_name(args)}",
                           trace_steps=args.trace_steps)
    server = Server(opt, model_name(args), max_queue=args.max_queue, metrics=not args.no_metrics, tracing=tracing,
                    **front_door)
    if front_door["access_log"]:
        show_access_log()
    warning = exposure_warning(args.host, bool(front_door["api_keys"]))
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)

    def ready(url: str) -> None:
        print(f"serving {server.model_name} on {url}/v1 (Ctrl-C or SIGTERM to stop)", flush=True)

    watch = None
    if group is not None:  # a lost rank: /health 503, a message, exit 1 (cli/ranks.py, runtime/rank_watch.py)
        watch = RankWatch(group, min(5.0, args.tp_timeout / 4), ranks.fatal_after(),
                          probe=lambda: server.engine.error).start()
    serve(server, args.host, args.port, shutdown_timeout=args.shutdown_timeout, on_ready=ready)
    if watch is not None:
        watch.stop()
        ranks.finish(opt)
    print("server stopped", file=sys.stderr, flush=True)
    return 0
