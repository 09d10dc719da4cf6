"""``segment`` stage: every trajectory of ``D_ct`` split into sub-goal segments (``D_st``).

    python -m flows.segment [--params params.yaml] [--data data]

Reads ``<data>/collect/d_ct.parquet``; writes ``<data>/segment/d_st.parquet``, the histogram of
turns per segment by success and failure (``segment_lengths.csv`` and ``.png``) and
``metrics.json``. The segmenter is ``segment.segmenter`` in params; ``llm`` reads its API key
from the environment variable named by ``segment.llm.api_key_env``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, require, stage_parser
from tasks.expert import check_env
from tasks.tracking import log_metrics, stage_run


@flow(name="segment", log_prints=True)
def segment_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.segment import segment, write_histogram

    params = load_or_exit(params_path, lambda p: check_env(p.env))
    use_cache_dir(data / "cache" / "prefect")
    d_ct = require(data / "collect" / "d_ct.parquet", "collect")
    out = data / "segment"
    sections = {"env": {"name": params.env.name}, "segment": params.segment.model_dump()}
    with stage_run(params, "segment", sections, reads=[d_ct], writes=[out]):
        rows, metrics = segment(params, d_ct, out / "d_st.parquet")
        write_histogram(rows, out / "segment_lengths.csv", out / "segment_lengths.png",
                        params.segment.segmenter)
        mlflow.log_artifact(str(out / "segment_lengths.png"))
        mlflow.log_artifact(str(out / "segment_lengths.csv"))
        log_metrics({"segment": metrics}, out / "metrics.json")
    m = metrics["mean_turns_per_segment"]
    print(f"D_st: {metrics['trajectories']} trajectories, {metrics['segments']} segments "
          f"({params.segment.segmenter}); mean turns per segment {m['all']:.2f} "
          f"(success {m['success']:.2f}, failure {m['failure']:.2f}); "
          f"{metrics['fallbacks']} fell back to turn")
    return metrics


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params, lambda p: check_env(p.env))
    segment_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
