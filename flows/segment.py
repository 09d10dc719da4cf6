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

from tasks.stage import checks, run_name, run_stage, stage_main
from tasks.tracking import log_metrics


@flow(name="segment", log_prints=True, flow_run_name=run_name("segment"))
def segment_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    from tasks.segment import segment, write_histogram

    d_ct, out = data / "collect" / "d_ct.parquet", data / "segment"
    with run_stage("segment", params_path, data, ["env.name", "segment"], check=checks(),
                   needs={d_ct: "collect"}, writes=[out]) as stage:
        segmenter = stage.params.segment.segmenter
        rows, metrics = segment(stage.params, d_ct, out / "d_st.parquet")
        write_histogram(rows, out / "segment_lengths.csv", out / "segment_lengths.png", segmenter)
        stage.log_files(out / "segment_lengths.png", out / "segment_lengths.csv")
        log_metrics({"segment": metrics}, out / "metrics.json")
    m = metrics["mean_turns_per_segment"]
    print(f"D_st: {metrics['trajectories']} trajectories, {metrics['segments']} segments "
          f"({segmenter}); mean turns per segment {m['all']:.2f} "
          f"(success {m['success']:.2f}, failure {m['failure']:.2f}); "
          f"{metrics['fallbacks']} fell back to turn")
    return metrics


main = stage_main(segment_flow, __doc__, checks())


if __name__ == "__main__":
    main()
