"""Progress of the long quantization steps (calibration, each method's per-layer loop, validate).

``progress=`` everywhere in :mod:`devin_compile.quant` takes ``True`` (a tqdm bar on stderr,
the default), ``False``/``None`` (silent) or a callable ``fn(done, total, *info)`` (the CLI
draws its rich bars through it).
"""
from __future__ import annotations

from typing import Any, Callable, Union

ProgressArg = Union[bool, None, Callable[..., Any]]


class Progress:
    """``with Progress(progress, total, desc) as p: ... p.update(done, *info)``."""

    def __init__(self, progress: ProgressArg, total: int, desc: str):
        self.fn = progress if callable(progress) else None
        self.bar = None
        if progress is True:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True)
        elif progress not in (False, None) and self.fn is None:
            raise ValueError(f"progress={progress!r} must be True, False or a callable fn(done, total, ...)")
        self.total = total

    def update(self, done: int, *info: Any) -> None:
        if self.fn is not None:
            self.fn(done, self.total, *info)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if info:
                self.bar.set_postfix_str(str(info[0]), refresh=False)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
