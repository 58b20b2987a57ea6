"""RL-level profiling that is always on: spans in every actor, per-step metrics, a
Perfetto-readable trace, plots and a bottleneck report (see ``spans`` for the recorder).

A run directory gets ``profile/spans.jsonl`` (drained spans), RL metrics in
``metrics.jsonl`` and ``tensorboard/``, and at the end ``trace.json``, ``report.txt`` and
``profile.png``; ``raytunix profile RUN_DIR`` makes the last three again from the files.
"""

from raytunix.profiling.spans import (
    ProfiledActor,
    Recorder,
    add,
    configure,
    current_flow,
    enabled,
    recorder,
    span,
)

__all__ = ["ProfiledActor", "Recorder", "add", "configure", "current_flow", "enabled", "recorder", "span",
           "write_artifacts"]


def write_artifacts(run_dir: str) -> dict:
    """Makes ``trace.json``, ``report.txt`` and ``profile.png`` in ``run_dir`` from its
    files. One that cannot be made is logged and left out: profiling never fails a run.

    Returns:
      ``{"trace_path", "report_path", "plot_path"}`` for those written, plus
      ``"bottleneck"`` (the verdict's resource) and ``"bottleneck_summary"``.
    """
    import logging

    log = logging.getLogger(__name__)
    out: dict = {}
    try:
        from raytunix.profiling.report import write_report

        out["report_path"], verdict = write_report(run_dir)
        out["bottleneck"], out["bottleneck_summary"] = verdict.resource, verdict.summary
    except Exception as e:  # noqa: BLE001 - a report bug must not cost the run its summary
        log.warning("profiling: report.txt not written: %r", e, exc_info=True)
    try:
        from raytunix.profiling.trace import write_trace

        out["trace_path"] = write_trace(run_dir)
    except Exception as e:  # noqa: BLE001
        log.warning("profiling: trace.json not written: %r", e, exc_info=True)
    try:
        from raytunix.profiling.plots import write_plots

        out["plot_path"] = write_plots(run_dir)
    except Exception as e:  # noqa: BLE001
        log.warning("profiling: profile.png not written: %r", e, exc_info=True)
    return out
