"""Serve every stage flow (and the whole pipeline) as a Prefect deployment, so the Prefect UI's
Run button starts a stage, with its parameters editable there.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve [--params params.yaml] [--data data]

Runs until interrupted (Ctrl-C); each flow run started from the UI or with
``prefect deployment run '<flow>/<flow>'`` executes in a subprocess of this one, in the
project folder. The deployments' default parameters point at ``--params`` and ``--data``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tasks.cli import load_or_exit, stage_parser


def deployments(params_path: Path, data: Path) -> list:
    """One deployment per flow, named like the flow, with the stage's default parameters."""
    from flows.collect import collect_flow
    from flows.evaluate import evaluate_flow
    from flows.expert import expert_flow
    from flows.hindsight import hindsight_flow
    from flows.pipeline import pipeline_flow
    from flows.ppo import ppo_flow
    from flows.report import report_flow
    from flows.rewards import rewards_flow
    from flows.segment import segment_flow
    from flows.sft import sft_flow
    from flows.sprm import sprm_flow
    from flows.start_curve import start_curve_flow

    common = {"params_path": str(params_path), "data": str(data)}
    pi_ref = str(data / "sft" / "pi_ref")
    specs = [(expert_flow, {}), (sft_flow, {}), (collect_flow, {"model": pi_ref}),
             (segment_flow, {}), (sprm_flow, {}), (hindsight_flow, {}), (rewards_flow, {}),
             (start_curve_flow, {"seed": 0}), (ppo_flow, {"variant": "hisr", "seed": 0}),
             (evaluate_flow, {"model": pi_ref, "name": "sft"}), (report_flow, {}),
             (pipeline_flow, {"start": "expert"})]
    return [f.to_deployment(name=f.name, parameters={**common, **extra},
                            description=(sys.modules[f.fn.__module__].__doc__ or "").strip())
            for f, extra in specs]


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params)
    from prefect import serve
    from prefect.settings import PREFECT_API_URL

    # Without a server, deployments would go to a temporary API that dies with this process.
    if not PREFECT_API_URL.value():
        raise SystemExit("error: PREFECT_API_URL is not set; start a server "
                         "(scripts/prefect_ui.sh) and export the URL it prints")

    serve(*deployments(args.params, args.data))


if __name__ == "__main__":
    main()
