"""``waterwave-hpo``: the command line (``demo``)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
import sys

from waterwave_hpo._version import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="waterwave-hpo",
        description="Run many Optuna trials on one GPU at once (co-hosted trials, one CUDA "
        "stream each).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="NAS + HPO search of small CNNs on scikit-learn's handwritten digits",
        description="A NAS + HPO search on scikit-learn's handwritten digits (1797 8x8 "
        "images): each trial picks a small CNN (depth, widths, kernels, dropout) and its "
        "training (optimizer, learning rate, batch size), trains for a few epochs and reports "
        "validation accuracy every epoch; a median pruner stops weak trials. Several trials "
        "train at once on each device. Writes study.log (resumable), trials.csv, summary.json "
        "and timeline.png to --out.",
    )
    demo.add_argument(
        "--trials",
        type=int,
        default=16,
        metavar="N",
        help="trials the study should hold when done (default 16)",
    )
    demo.add_argument(
        "--concurrency",
        type=int,
        default=4,
        metavar="K",
        help="trials at once per device (default 4)",
    )
    demo.add_argument(
        "--epochs", type=int, default=5, metavar="E", help="training epochs per trial (default 5)"
    )
    demo.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="auto | cpu | cuda | cuda:N (default auto: every GPU, else the CPU)",
    )
    demo.add_argument("--seed", type=int, default=0, metavar="S", help="seed (default 0)")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("waterwave-demo"),
        metavar="DIR",
        help="run directory (default ./waterwave-demo); an existing one is resumed",
    )
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("-v", "--verbose", action="store_true", help="log every trial")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


def _demo(args: argparse.Namespace) -> int:
    import optuna

    from waterwave_hpo.demo import DemoConfig
    from waterwave_hpo.demo import run_demo

    logging.basicConfig(
        format="%(message)s", level=logging.INFO if args.verbose else logging.WARNING
    )
    optuna.logging.set_verbosity(optuna.logging.INFO if args.verbose else optuna.logging.WARNING)
    for name, minimum in (("trials", 0), ("concurrency", 1), ("epochs", 1)):
        if getattr(args, name) < minimum:
            print(
                f"waterwave-hpo demo: error: --{name} {getattr(args, name)} must be >= {minimum}",
                file=sys.stderr,
            )
            return 2
    config = DemoConfig(
        trials=args.trials,
        concurrency=args.concurrency,
        epochs=args.epochs,
        device=args.device,
        seed=args.seed,
        out=args.out,
        show_progress_bar=not args.no_progress,
    )
    try:
        result = run_demo(config)
    except ValueError as error:
        print(f"waterwave-hpo demo: error: {error}", file=sys.stderr)
        return 2
    s = result.summary
    print(
        f"{s['n_trials']} trials ({s['n_complete']} complete, {s['n_pruned']} pruned, "
        f"{s['n_fail']} failed); {s['n_trials_this_run']} ran now in {s['wall_time_s']:.1f} s "
        f"on {', '.join(s['device'])}, up to {s['max_concurrent_trials']} at once."
    )
    if s["best_value"] is not None:
        print(f"best: trial {s['best_trial']}, validation accuracy {s['best_value']:.4f}")
        print(f"      {json.dumps(s['best_params'], sort_keys=True)}")
    print(f"wrote {result.out}/: study.log trials.csv summary.json timeline.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
