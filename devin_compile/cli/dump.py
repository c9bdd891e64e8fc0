"""``devin-compile dump``: optimize a model and write the pass-by-pass dumps."""
from __future__ import annotations

from . import common

HELP = "optimize a model and write pass-by-pass dumps (index.md, NN_<pass>.py, NN_<pass>.txt)"
DESCRIPTION = ("Optimize a model and write, for every pass, the graph after it as readable code (NN_<pass>.py) "
               "and as nodes with shape:dtype (NN_<pass>.txt), and index.md (pass, time, matches, node delta).")


def add_arguments(p) -> None:
    common.add_model_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for NN_<pass>.py/.txt and index.md")
    p.add_argument("--verify", action="store_true", help="re-run a probe after each pass and report drift")
    p.set_defaults(fn=main)


def main(args) -> int:
    options = common.check_options(args, dump_dir=args.out, verify=args.verify)
    con = common.console()
    model, tok = common.load(args, con)
    opt = common.optimize(model, tok, con, **options)
    con.print(f"dumps written to {args.out} (index.md, NN_<pass>.py, NN_<pass>.txt); "
              f"{len(opt.pass_report.records)} passes")
    return 0
