"""The arena-block reuse pool that keeps calls across a CPython frame-stack chunk boundary cheap."""
import gc
import os
import subprocess
import sys

import pytest

from devin_compile.runtime import arena_reuse

pytestmark = pytest.mark.skipif(not arena_reuse.needed(), reason="CPython >= 3.13 caches stack chunks itself")


def _depth(n: int) -> int:
    return 0 if n == 0 else _depth(n - 1) + 1


def test_engine_installs_it_and_chunk_churn_is_served_from_the_cache():
    import devin_compile.runtime.engine  # noqa: F401  (the engine installs it when built)

    assert arena_reuse.install()
    before = arena_reuse.stats()
    for _ in range(50):  # ~400 frames of ~100 bytes: crosses at least one 16 KiB chunk per call
        assert _depth(400) == 400
    after = arena_reuse.stats()
    assert after["hits"] - before["hits"] >= 49
    assert after["misses"] - before["misses"] <= 4


def test_objects_and_arenas_survive_heavy_allocation():
    arena_reuse.install()
    for _ in range(3):  # fills and frees many pymalloc arenas through the cache
        junk = [[i, str(i), (i,)] for i in range(200_000)]
        assert sum(row[0] for row in junk) == sum(range(200_000))
        del junk
        gc.collect()
    assert arena_reuse.stats()["released"] > 0  # more than the cache holds went back


def test_can_be_turned_off():
    code = ("import devin_compile.runtime.engine; from devin_compile.runtime import arena_reuse as c;"
            "print(c.needed(), c.install())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DEVIN_COMPILE_ARENA_CACHE": "0"}).stdout
    assert out.split() == ["False", "False"]
