"""Does fusion take the models people train? A sample of timm and transformers.

For each of the 31 timm models of the fusion zoo (convolutional, MLP, hybrid and attention families;
64x64 inputs, or the model's own size where it is fixed; batch 2) and four transformers models
built from small configs (BERT, GPT-2, ViT, T5: 2 layers, width 64), it builds K=2 fresh copies
(random weights, dropout and drop-path at 0, train mode), calls
``fusion.fuse(models, example_inputs=..., example_kwargs=...)`` (which runs ``fusion.verify``:
forward and backward against the models alone) and then checks the fused module independently:
a forward against each model alone and a backward. Each model ends in one of four rows:

* fused: accepted, every output within 2e-4 of its largest magnitude of the model alone;
* refused: ``fuse`` raised a ``FusionError`` (or its up-front refusal) naming the module path;
* crashed: any other error (the count the issue asks to be 0);
* wrong: accepted, but an output differs.

Run (needs the ``zoo`` extra: ``pip install -e ".[zoo]"``)::

    python experiments/fusion_zoo.py            # the whole sample, ~10 min on a quiet 2-core VM
    python experiments/fusion_zoo.py --fast     # the CI subset

Writes results.json and README.md to ``--out``
(default ``experiments/results/<date>-fusion-zoo/``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path
import platform
import sys
import warnings

import torch

from waterwave_hpo.bench import ZooOutcome
from waterwave_hpo.bench import check_case
from waterwave_hpo.bench import import_timm
from waterwave_hpo.bench import zoo_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the CI subset only")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path("experiments/results") / f"{dt.date.today()}-fusion-zoo"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    timm = import_timm()
    import transformers

    rows = []
    load_before = os.getloadavg()
    for case in zoo_cases(fast=args.fast):
        result = check_case(case)
        row = {
            "library": result.library,
            "model": result.name,
            "outcome": result.outcome.value,
            "output_error": result.output_error,
            "path": result.path,
            "detail": result.detail,
            "seconds": round(result.seconds, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    machine = {
        "machine": f"{platform.machine()} VM, {os.cpu_count()} cores, CPU only",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (out / "README.md").write_text(render(machine, rows))
    print(f"wrote {out}/results.json and README.md")


def render(machine: dict[str, object], rows: list[dict[str, object]]) -> str:
    counts = {o.value: sum(r["outcome"] == o.value for r in rows) for o in ZooOutcome}
    lines = [
        "# Fusion on a model zoo",
        "",
        f"Machine: {machine['machine']}; Python {machine['python']}, torch {machine['torch']}, "
        f"timm {machine['timm']}, transformers {machine['transformers']}, "
        f"{machine['threads']} torch thread(s); load average {machine['loadavg_before']} before, "
        f"{machine['loadavg_after']} after. Command: `python experiments/{machine['command']}`, "
        f"{machine['date_utc']}.",
        "",
        "K=2 fresh copies per model, train mode, dropout and drop-path 0; batch 2; timm at "
        "64x64 (or its fixed input size), transformers from small configs (2 layers, width 64). "
        "`fuse(models, example_inputs=...)` verifies forward and backward; the fused module is "
        "then checked again, independently, against each model alone.",
        "",
        "| outcome | count |",
        "| --- | --- |",
        *[f"| {name} | {count} |" for name, count in counts.items()],
        "",
        "| library | model | outcome | output error | module refused | seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        error = r["output_error"]
        shown = f"{error:.1e}" if isinstance(error, float) and error == error else "-"
        path = "" if r["path"] is None else f"`{r['path'] or '<model>'}`"
        lines.append(
            f"| {r['library']} | {r['model']} | {r['outcome']} | {shown} | {path} | "
            f"{r['seconds']} |"
        )
    details = [r for r in rows if r["detail"]]
    if details:
        lines += ["", "Messages of the models not fused:", ""]
        lines += [f"- {r['model']}: {r['detail']}" for r in details]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
