"""``waterwave-hpo``: the command line (``demo``, ``bench``, ``doctor``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import logging
from pathlib import Path
import re
import shlex
import sys
from typing import Any

from waterwave_hpo import _checks
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
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seeds the sampler (the same parameters again only with --concurrency 1) and each "
        "trial's initialization, batch order and dropout from S and the trial number (the same "
        "training for the same parameters at any concurrency); default 0",
    )
    demo.add_argument(
        "--out",
        default="waterwave-demo",
        metavar="DIR",
        help="run directory (default ./waterwave-demo); an existing one is resumed (with the "
        "same --epochs and --seed), also after a kill, and may be shared by several demo "
        "processes at once",
    )
    demo.add_argument(
        "--fuse",
        type=int,
        default=None,
        metavar="K",
        help="fused search: one MLP structure, numbers only (learning rate, weight decay, "
        "momentum, dropout); each slot trains up to K trials as one fused model (HFTA), each "
        "trial still reported, pruned and ended on its own (default: off, the NAS search)",
    )
    demo.add_argument(
        "--isolation",
        choices=("threads", "process"),
        default="threads",
        help="threads (default): trials share this process and its memory pool; process: each "
        "slot trains its trials in a worker process of its own, so a crash fails one trial",
    )
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("-v", "--verbose", action="store_true", help="log every trial")
    _add_bench(commands)
    _add_doctor(commands)
    return parser


def _add_doctor(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    doctor = commands.add_parser(
        "doctor",
        help="check this installation on this machine's GPU (or the simulated device)",
        description="Print versions (torch, CUDA, driver, CuPy, Optuna, Ray), check that the "
        "memory pool is built and loads, then run acceptance checks on the GPU, each "
        "PASS/FAIL/SKIP with its figure: pool install order, allocation latency against "
        "PyTorch's allocator, a cross-stream canary, out of memory raised and recovered, cuDNN "
        "convolutions with and without benchmark mode, a two-trial co-hosted study against one "
        "at a time, CuPy on the trial's stream. Without a GPU the same checks run on the "
        "simulated device. Writes a JSON report to attach to bug reports; exits 1 if a check "
        "failed. Run it in a fresh process: on CUDA it installs the pool first.",
    )
    doctor.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="auto | cpu | cuda | cuda:N (default auto: the first GPU, else the simulated "
        "device; cpu forces the simulated device)",
    )
    doctor.add_argument(
        "--json",
        default="waterwave-doctor.json",
        metavar="PATH",
        help="where to write the JSON report (default ./waterwave-doctor.json)",
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from waterwave_hpo.bench import SearchMethod
    from waterwave_hpo.bench import Setting
    from waterwave_hpo.bench import Workload

    bench = commands.add_parser(
        "bench",
        help="compare ways of sharing one device (temporal, Optuna threads, processes, "
        "cudaMallocAsync, waterwave) on the same trials",
        description="Run a ResNet-style CNN, a GPT-style language model and the demo's digits "
        "NAS, each at a light and a high memory demand, under every way of sharing the device "
        "(temporal; Optuna n_jobs=K threads; K processes, with MPS if running; "
        "cudaMallocAsync with K streams, CUDA only; the waterwave executor with the fifo and "
        "waterwave policies, and with HOME memory plans instead of NodeGroup gates; fused: K "
        "trials of one structure trained as one model), with the "
        "same trials, seeds and batch sizes. Writes README.md, "
        "results.csv, results.json and plots to --out, and prints the simulator's prediction "
        "beside each measurement. On a CPU-only machine everything runs at small scale and "
        "says so.",
    )
    bench.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="results folder (default experiments/results/<date>-<device>/; with --search "
        "experiments/results/<date>-search-<device>/)",
    )
    bench.add_argument(
        "--device", default="auto", metavar="DEVICE", help="auto | cpu | cuda | cuda:N"
    )
    bench.add_argument("--k", type=int, default=4, metavar="K", help="trials at once (default 4)")
    bench.add_argument(
        "--trials",
        type=int,
        default=None,
        metavar="N",
        help="trials per workload (default 8); with --search, each search's trial budget "
        "(default 100)",
    )
    bench.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        choices=[w.value for w in Workload],
        metavar="W",
        help="resnet gpt digits (default all; not with --search)",
    )
    bench.add_argument(
        "--settings",
        nargs="+",
        default=None,
        choices=[s.value for s in Setting],
        metavar="S",
        help="light high (default both; not with --search)",
    )
    bench.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="M",
        help="temporal optuna-threads spatial cuda-malloc-async waterwave-fifo waterwave "
        "waterwave-plans fused (default all; temporal always runs: it is the baseline); with "
        "--search: " + " ".join(m.value for m in SearchMethod) + " (default all)",
    )
    bench.add_argument(
        "--budget-s",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="wall time the whole matrix should take; scales the steps per trial (default "
        "600); with --search, the searches' wall time in all, split evenly between them "
        "(start-up comes on top)",
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="training steps per trial (default: fitted to --budget-s; not with --search)",
    )
    bench.add_argument(
        "--capacity-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="device memory to size the settings against (default: the GPU's total; on the "
        "CPU a virtual capacity derived from the trials' profiles; not with --search)",
    )
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed; with --search the first seed (default 0)",
    )
    bench.add_argument(
        "--no-sim",
        action="store_true",
        help="do not print the simulator's predictions (not with --search)",
    )
    search = bench.add_argument_group(
        "--search: time to a good model",
        "Run the demo's NAS + HPO search on scikit-learn's digits under each way of sharing "
        "the device (one at a time; Optuna n_jobs=K; the executor with K threads; the "
        'executor with isolation="process"; fused, fuse=K, one architecture per batch), the '
        "same sampler (TPE, seeded; constant liar when trials run at once), pruner, trial "
        "budget and time budget, --seeds times each. Writes search.json (per method and seed: "
        "seconds until the best validation accuracy reached the target, the best at the "
        "budget, trials completed), search.png (best-so-far accuracy against wall seconds) "
        "and README.md.",
    )
    search.add_argument(
        "--search", action="store_true", help="run the search bench instead of the matrix"
    )
    search.add_argument(
        "--seeds", type=int, default=None, metavar="N", help="searches per method (default 3)"
    )
    search.add_argument(
        "--epochs", type=int, default=None, metavar="E", help="epochs per trial (default 5)"
    )
    search.add_argument(
        "--target-fraction",
        type=float,
        default=None,
        metavar="F",
        help="the target: this fraction of the best validation accuracy any search found "
        "within its budget (default 0.99)",
    )


def _out_folder(value: object) -> None:
    from waterwave_hpo._owned_files import check_out_value

    check_out_value("out", value)


def _json_path(value: object) -> None:
    from waterwave_hpo.doctor import check_report_path

    check_report_path(value)


def _at_least(minimum: int, fix: str | None = None) -> Callable[[str, object], object]:
    return lambda name, value: _checks.check_int(name, value, minimum=minimum, fix=fix)


def _optional(check: Callable[[str, object], object]) -> Callable[[str, object], object]:
    return lambda name, value: None if value is None else check(name, value)


# Each option of each command, checked right after parsing, before a library sees its value
# (NumPy's seed range, torch's device parser, pandas' writers): the refusal names the flag.
OPTION_CHECKS: dict[str, dict[str, Callable[[str, object], object]]] = {
    "demo": {
        "trials": _at_least(0),
        "concurrency": _at_least(1),
        "epochs": _at_least(1),
        "seed": _checks.check_seed,
        "fuse": _optional(
            _at_least(1, "pass the trials per fused model, e.g. --fuse 4, or leave it out")
        ),
        "out": lambda _, value: _out_folder(value),
    },
    "bench": {
        "k": _at_least(1),
        "trials": _optional(_at_least(1)),
        "seeds": _optional(_at_least(1)),
        "epochs": _optional(_at_least(1)),
        "target_fraction": _optional(
            lambda name, value: _checks.check_number(
                name, value, fix="pass a fraction in (0, 1], e.g. 0.99"
            )
        ),
        "budget_s": lambda name, value: _checks.check_finite_number(
            name, value, fix="pass seconds, e.g. 600"
        ),
        "steps": _optional(_at_least(1, "pass steps, or leave it out to fit --budget-s")),
        "capacity_bytes": _optional(_at_least(1, "pass bytes, or leave it out")),
        "seed": _checks.check_seed,
        "out": _optional(lambda _, value: _out_folder(value)),
    },
    "doctor": {"json": lambda _, value: _json_path(value)},
}
"""Per command, per option (its ``dest``): the check its value must pass."""


def _refusal(args: argparse.Namespace) -> str | None:
    """The first option of ``args`` that its check refuses, in the flag's terms, or ``None``."""
    for dest, check in OPTION_CHECKS[args.command].items():
        try:
            check(dest, getattr(args, dest))
        except (TypeError, ValueError) as error:
            return _as_flags(str(error))
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args = _parser().parse_args(argv)
    refusal = _refusal(args)
    if refusal is not None:
        print(f"waterwave-hpo {args.command}: error: {refusal}", file=sys.stderr)
        return 2
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "doctor":
        return _doctor(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


def _demo(args: argparse.Namespace) -> int:
    import optuna

    from waterwave_hpo.demo import DemoConfig
    from waterwave_hpo.demo import DemoSettingError
    from waterwave_hpo.demo import run_demo
    from waterwave_hpo.executor import StorageWriteError

    logging.basicConfig(
        format="%(message)s", level=logging.INFO if args.verbose else logging.WARNING
    )
    optuna.logging.set_verbosity(optuna.logging.INFO if args.verbose else optuna.logging.WARNING)
    config = DemoConfig(
        trials=args.trials,
        concurrency=args.concurrency,
        epochs=args.epochs,
        device=args.device,
        seed=args.seed,
        out=Path(args.out),
        show_progress_bar=not args.no_progress,
        fuse=args.fuse,
        isolation=args.isolation,
    )
    try:
        result = run_demo(config)
    except DemoSettingError as error:
        print(f"waterwave-hpo demo: error: {error.flag_message}", file=sys.stderr)
        return 2
    except ValueError as error:  # JournalDamagedError names the file, the line and the fix
        print(f"waterwave-hpo demo: error: {error}", file=sys.stderr)
        return 2
    except StorageWriteError as error:  # the journal stopped taking writes mid-run
        print(f"waterwave-hpo demo: error: --out {args.out}: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the journal cannot be opened or written
        print(
            f"waterwave-hpo demo: error: --out {args.out}: cannot use its study.log ({error}); "
            "pass a directory you can write to.",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # outside the trials (opening the study, writing the files)
        print(
            "waterwave-hpo demo: interrupted outside the trials; run the same command again to "
            "resume.",
            file=sys.stderr,
        )
        return 130
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
    if result.interrupted:
        print(
            f"Interrupted: {s['n_trials']} of {args.trials} trials done; the trials that were "
            "running do not count and run again with their parameters on resume. Resume with:\n"
            f"  waterwave-hpo demo --trials {args.trials} --epochs {args.epochs} "
            f"--seed {args.seed} --out {shlex.quote(str(result.out))}"
            + ("" if args.fuse is None else f" --fuse {args.fuse}")
            + ("" if args.isolation == "threads" else f" --isolation {args.isolation}"),
            file=sys.stderr,
        )
        return 130
    return 0


_MATRIX_ONLY = ("workloads", "settings", "steps", "capacity_bytes", "no_sim")
_SEARCH_ONLY = ("seeds", "epochs", "target_fraction")


def _mode_refusal(args: argparse.Namespace) -> str | None:
    """A flag of one bench given to the other (``--workloads`` with ``--search``), or ``None``."""
    if args.search:
        given = [d for d in _MATRIX_ONLY if getattr(args, d) not in (None, False)]
        fix = "the search bench runs the demo's search only; leave it out"
    else:
        given = [d for d in _SEARCH_ONLY if getattr(args, d) is not None]
        fix = "add --search to run the search bench, or leave it out"
    if not given:
        return None
    flag = "--" + given[0].replace("_", "-")
    value = getattr(args, given[0])
    shown = (
        ""
        if value is True
        else " " + " ".join(map(str, value if isinstance(value, list) else [value]))
    )
    where = "the throughput matrix" if args.search else "--search"
    return f"{flag}{shown}: applies to {where} only; {fix}."


def _methods(args: argparse.Namespace) -> tuple[Any, ...] | str:
    """``--methods`` as the mode's method values, or the refusal naming the flag."""
    from waterwave_hpo.bench import Method
    from waterwave_hpo.bench import SearchMethod

    kind: Any = SearchMethod if args.search else Method
    if args.methods is None:
        return tuple(kind)
    known = {m.value: m for m in kind}
    for value in args.methods:
        if value not in known:
            what = "a way of running the search" if args.search else "a bench method"
            return f"--methods {value}: is not {what}; pass some of {' '.join(known)}."
    return tuple(known[value] for value in args.methods)


def _bench(args: argparse.Namespace) -> int:
    import optuna

    from waterwave_hpo.bench import BenchConfig
    from waterwave_hpo.bench import SearchConfig
    from waterwave_hpo.bench import Setting
    from waterwave_hpo.bench import Workload
    from waterwave_hpo.bench import run_bench
    from waterwave_hpo.bench import run_search_bench

    methods = _methods(args)
    refusal = _mode_refusal(args) or (methods if isinstance(methods, str) else None)
    if refusal is not None:
        print(f"waterwave-hpo bench: error: {refusal}", file=sys.stderr)
        return 2
    assert not isinstance(methods, str)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = None if args.out is None else Path(args.out)
    command = ("waterwave-hpo", *sys.argv[1:])
    try:
        if args.search:
            run_search_bench(
                SearchConfig(
                    out=out,
                    device=args.device,
                    k=args.k,
                    methods=methods,
                    seeds=3 if args.seeds is None else args.seeds,
                    seed=args.seed,
                    trials=100 if args.trials is None else args.trials,
                    epochs=5 if args.epochs is None else args.epochs,
                    budget_s=args.budget_s,
                    target_fraction=(
                        0.99 if args.target_fraction is None else args.target_fraction
                    ),
                    command=command,
                )
            )
            return 0
        config = BenchConfig(
            out=out,
            device=args.device,
            k=args.k,
            trials=8 if args.trials is None else args.trials,
            workloads=tuple(Workload(w) for w in args.workloads or [w.value for w in Workload]),
            settings=tuple(Setting(s) for s in args.settings or [s.value for s in Setting]),
            methods=methods,
            steps=args.steps,
            budget_s=args.budget_s,
            capacity_bytes=args.capacity_bytes,
            seed=args.seed,
            simulate=not args.no_sim,
            command=command,
        )
        run_bench(config)
    except ValueError as error:
        print(f"waterwave-hpo bench: error: {_as_flags(str(error))}", file=sys.stderr)
        return 2
    except OSError as error:  # --out cannot be created or written
        print(
            f"waterwave-hpo bench: error: --out {args.out}: cannot write there ({error}); pass a "
            "directory you can write to.",
            file=sys.stderr,
        )
        return 2
    return 0


def _as_flags(text: str) -> str:
    """A library message (``budget_s=-1.0: ...``) in the command line's terms (``--budget-s``)."""
    match = re.match(r"(\w+)=(PosixPath\('[^']*'\)|'[^']*'|[^\s:]+):?", text)
    if match is None:
        return text
    flag = "--" + match.group(1).replace("_", "-")
    if match.group(2).startswith("PosixPath("):
        return f"{flag} {match.group(2)[11:-2]}:{text[match.end() :]}"
    return f"{flag} {match.group(2).strip(chr(39)) or chr(39) * 2}:{text[match.end() :]}"


def _doctor(args: argparse.Namespace) -> int:
    import optuna

    from waterwave_hpo.doctor import run_doctor

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        report = run_doctor(args.device)
    except ValueError as error:
        print(f"waterwave-hpo doctor: error: {error}", file=sys.stderr)
        return 2
    print(report.text())
    try:
        report.write(Path(args.json))
    except ValueError as error:  # the file appeared while the checks ran, and is not a report
        print(f"waterwave-hpo doctor: error: {_as_flags(str(error))}", file=sys.stderr)
        return 2
    except OSError as error:
        print(
            f"waterwave-hpo doctor: error: --json {args.json}: cannot write the report "
            f"({error}); pass a path you can write to (the checks above ran).",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {args.json}")
    return report.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
