"""Rebuild the calibration set shipped in ``devin_compile/quant/data/calibration/``.

    python tools/build_calibration_set.py [--python-lib /usr/lib/python3.11] [--shakespeare ../shared/data/tinyshakespeare.txt]

Every file is cut from a named, license-clean source (see devin_compile/quant/data/README.md);
the prose and the French, German and Spanish text are the project's own writing and are kept
as they are (this tool does not touch ``prose-en.txt`` or ``multilingual.txt``). Deterministic:
the same inputs give the same bytes.
"""
from __future__ import annotations

import argparse
import ast
import csv
import importlib
import io
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "devin_compile" / "quant" / "data" / "calibration"

# the head of tinyshakespeare (public domain); evaluation slices come from the file's end
DIALOGUE_CHARS = 40_000
REFERENCE_CHARS = 50_000
CODE_FILES = ("textwrap.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py", "colorsys.py", "graphlib.py")
CODE_CHARS = 45_000
MARKUP_MODULES = ("abc", "argparse", "array", "base64", "bisect", "calendar", "cmath", "codecs", "collections",
                  "colorsys", "contextlib", "copy", "csv", "datetime", "decimal", "difflib", "enum", "filecmp",
                  "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib",
                  "heapq", "hmac", "html", "inspect", "io", "ipaddress", "itertools", "json", "keyword", "locale",
                  "logging", "math", "mimetypes", "operator", "os", "pathlib", "pickle", "platform", "pprint",
                  "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "signal", "socket", "sqlite3",
                  "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
                  "time", "timeit", "tokenize", "traceback", "types", "typing", "unicodedata", "uuid", "warnings",
                  "weakref", "zipfile", "zlib")


def first_line(doc: str | None) -> str:
    return doc.strip().split("\n")[0].strip() if isinstance(doc, str) else ""


def public_functions(mod) -> list[tuple[str, str]]:
    out = []
    for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
        obj = getattr(mod, name, None)
        if name.startswith("_") or not callable(obj):
            continue
        out.append((name, first_line(getattr(obj, "__doc__", ""))))
    return out[:6]


def markup() -> str:
    """Lists and markup (Markdown, JSON, CSV, HTML, INI, YAML) built from the standard library's
    own docstrings: the structure is what matters, the facts are real."""
    mods = []
    for m in MARKUP_MODULES:
        try:
            mod = importlib.import_module(m)
        except ImportError:
            continue
        mods.append((m, first_line(mod.__doc__) or f"The {m} module.", public_functions(mod)))
    parts = ["# Standard library modules\n", "| module | summary | functions |", "|---|---|---:|"]
    parts += [f"| `{m}` | {d} | {len(fs)} |" for m, d, fs in mods[:25]]
    parts.append("\n## Checklist\n")
    for m, d, fs in mods[25:40]:
        parts.append(f"- [ ] **{m}**: {d}")
        parts += [f"  - `{m}.{f}()` — {fd or 'no summary'}" for f, fd in fs[:3]]
    parts.append("\n```json")
    parts.append(json.dumps([{"module": m, "summary": d, "functions": [f for f, _ in fs]} for m, d, fs in mods[40:52]],
                            indent=2, ensure_ascii=False))
    parts.append("```\n")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["module", "function", "summary"])
    for m, _d, fs in mods[52:62]:
        for f, fd in fs:
            w.writerow([m, f, fd])
    parts.append(buf.getvalue())
    parts.append("<dl class=\"modules\">")
    for m, d, _fs in mods[62:70]:
        parts.append(f"  <dt><a href=\"library/{m}.html\">{m}</a></dt>\n  <dd>{d.replace('&', '&amp;').replace('<', '&lt;')}</dd>")
    parts.append("</dl>\n")
    parts.append("[modules]")
    parts += [f"{m}.enabled = true\n{m}.functions = {len(fs)}" for m, _d, fs in mods[70:76]]
    parts.append("\nmodules:")
    for m, d, fs in mods[76:]:
        parts.append(f"  - name: {m}\n    summary: \"{d}\"\n    functions: [{', '.join(f for f, _ in fs)}]")
    return "\n".join(parts) + "\n"


def reference(lib: Path) -> str:
    """The Python Language Reference as pydoc ships it (``pydoc_data/topics.py``)."""
    tree = ast.parse((lib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    topics = ast.literal_eval(tree.body[-1].value)
    out, size = [], 0
    for name in sorted(topics):
        if size >= REFERENCE_CHARS:
            break
        text = topics[name].strip() + "\n\n"
        out.append(text)
        size += len(text)
    return "".join(out)[:REFERENCE_CHARS]


def code(lib: Path) -> str:
    out, size = [], 0
    for f in CODE_FILES:
        text = (lib / f).read_text(encoding="utf-8")
        out.append(f"# ---- Lib/{f} (CPython, PSF License) ----\n{text}\n")
        size += len(out[-1])
        if size >= CODE_CHARS:
            break
    return "".join(out)[:CODE_CHARS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python-lib", default=f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}")
    ap.add_argument("--shakespeare", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"
                                                 / "tinyshakespeare.txt"))
    args = ap.parse_args()
    lib = Path(args.python_lib)
    OUT.mkdir(parents=True, exist_ok=True)
    text = Path(args.shakespeare).read_text(encoding="utf-8")[:DIALOGUE_CHARS]
    (OUT / "dialogue-shakespeare.txt").write_text(text[: text.rfind("\n\n") + 1], encoding="utf-8")
    (OUT / "technical-python-reference.txt").write_text(reference(lib), encoding="utf-8")
    (OUT / "code-python-stdlib.txt").write_text(code(lib), encoding="utf-8")
    (OUT / "markup-lists.txt").write_text(markup(), encoding="utf-8")
    for f in sorted(OUT.iterdir()):
        print(f"{f.name:34} {f.stat().st_size:8d} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
