"""``devin-compile cache ls|clear``: show or empty the on-disk compile cache."""
from __future__ import annotations

import argparse
import json

HELP = "show (ls) or empty (clear) the on-disk compile cache"
DESCRIPTION = ("The compile cache holds what optimize() would otherwise redo on every start of the same model: "
               "the compiled program and the weights its passes made (packed, fused, quantized), under "
               "$DEVIN_COMPILE_CACHE/programs (default ~/.cache/devin_compile), bounded by "
               "$DEVIN_COMPILE_CACHE_MAX_BYTES (default 8 GiB, least recently used entries go first). "
               "torch's own compile caches for compile_decode (inductor/, Inductor's FX-graph and AOTAutograd "
               "caches, unless TORCHINDUCTOR_CACHE_DIR is set) are shown and emptied with it. "
               "Built kernels (kernels/) are kept by clear.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["ls", "clear"], help="ls: one line per entry; clear: remove them all")
    p.set_defaults(fn=run)


def _model(parts: dict) -> str:
    try:
        config = json.loads(parts.get("model_config", "{}"))
    except ValueError:
        return "?"
    return ",".join(config.get("architectures") or [config.get("model_type", "?")])


def _torch(parts: dict) -> str:
    try:
        return json.loads(parts.get("versions", "{}")).get("torch", "?")
    except ValueError:
        return "?"


def run(args) -> int:
    from ..compile_cache.inductor_cache import clear_inductor, inductor_bytes, inductor_dir
    from ..compile_cache.store import ProgramStore, age, max_bytes

    store = ProgramStore()
    inductor = inductor_dir()
    if args.action == "clear":
        freed = store.clear()
        print(f"cleared {store.folder}: {freed / 1e6:.1f} MB freed")
        if inductor.is_dir():
            print(f"cleared {inductor}: {clear_inductor() / 1e6:.1f} MB freed")
        return 0
    entries = store.entries()
    for e in reversed(entries):  # most recently used first
        print(f"{e.key}  {e.bytes / 1e6:8.2f} MB  used {age(e.last_used):>9}  {_model(e.parts)}  torch {_torch(e.parts)}"
              f"{'  (damaged)' if store.damage(e.key) else ''}")
    total = sum(e.bytes for e in entries)
    noun = "entry" if len(entries) == 1 else "entries"
    print(f"{len(entries)} {noun}, {total / 1e6:.2f} MB in {store.folder} (bound {max_bytes() / 1e6:.0f} MB)")
    if inductor.is_dir():
        print(f"torch's compile caches (compile_decode): {inductor_bytes() / 1e6:.2f} MB in {inductor}")
    return 0
