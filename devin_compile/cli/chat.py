"""``devin-compile chat``: an interactive terminal chat, the reply streamed as it is generated."""
from __future__ import annotations

import sys

from . import common
from .serve import add_optimize_arguments, load_optimized, optimize_options

HELP = "chat with a model in the terminal (history kept, replies streamed)"
DESCRIPTION = ("Load SmolLM2-135M-Instruct (or --model PATH), optimize it, and chat: each line you type is a user "
               "message, the reply is streamed as it is generated, and the conversation so far is sent each turn "
               "through the tokenizer's chat template. /reset forgets the history, /exit (or end of input) quits.")


def add_arguments(p) -> None:
    add_optimize_arguments(p)
    p.add_argument("--system", metavar="TEXT", help="a system message to start the conversation with")
    p.add_argument("--max-new-tokens", type=common.int_at_least(1), default=256, metavar="N",
                   help="most tokens in one reply (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed for sampling")
    p.set_defaults(fn=main)


def main(args) -> int:
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    options = optimize_options(args)
    con = common.console()
    opt = load_optimized(args, options, con)
    tok = opt.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template, so it cannot chat; use devin-compile run")
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    sampling = dict(do_sample=args.temperature > 0, temperature=args.temperature or 1.0, seed=args.seed)
    interactive = sys.stdin.isatty()
    limit = opt.engine.max_model_len
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(start)
            print("(history cleared)", flush=True)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        ids = opt.chat_ids(history)
        while len(ids) + 1 >= limit and len(history) > len(start) + 1:  # drop the oldest turns that do not fit
            del history[len(start):len(start) + 2]
            ids = opt.chat_ids(history)
        if len(ids) + 1 >= limit:
            print(f"(that message is too long for the model's context of {limit} tokens)", flush=True)
            history.pop()
            continue
        print("assistant> ", end="", flush=True)
        reply = []
        for piece in opt.stream_text(ids, min(args.max_new_tokens, limit - len(ids)), **sampling):
            reply.append(piece)
            print(piece, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0
