"""RL-level profiling that is always on: spans in every actor, per-step metrics, a
Perfetto-readable trace, plots and a bottleneck report (see ``spans`` for the recorder).

A run directory gets ``profile/spans.jsonl`` (drained spans), RL metrics in
``metrics.jsonl`` and ``tensorboard/``, and at the end ``trace.json``, ``report.txt`` and
``profile.png``; ``raytunix profile RUN_DIR`` makes the last three again from the files.
"""

import os

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

__all__ = [
    "ProfiledActor",
    "Recorder",
    "add",
    "configure",
    "current_flow",
    "enabled",
    "recorder",
    "span",
    "write_artifacts",
]


ARTIFACTS = {"report": "report.txt", "trace": "trace.json", "plot": "profile.png"}


def write_artifacts(run_dir: str, out_dir: str | None = None, log_errors: bool = True) -> dict:
    """Makes ``report.txt``, ``trace.json`` and ``profile.png`` from the files of
    ``run_dir``, in ``out_dir`` (default: the run directory). One that cannot be made is
    reported and left out: profiling never fails a run.

    Returns:
      ``{"report_path", "trace_path", "plot_path"}`` for those written; ``"report_text"``,
      ``"bottleneck"`` (the verdict's resource), ``"bottleneck_summary"``,
      ``"learning_signal"`` (``"none"``, ``"ok"`` or ``"unknown"``) and
      ``"learning_signal_summary"`` when the report could be made (also if it could not be
      written); ``"errors"``: ``{file
      name: why it was not written}``, each also logged as a warning unless
      ``log_errors`` is false (a caller that prints them itself).
    """
    import logging

    log = logging.getLogger(__name__)
    out_dir = out_dir or run_dir
    out: dict = {"errors": {}}

    def attempt(kind: str, make) -> None:
        name = ARTIFACTS[kind]
        try:
            out[f"{kind}_path"] = make(os.path.join(out_dir, name))
        except OSError as e:  # a missing input, a full or read-only disk: say it in a line
            out["errors"][name] = f"{type(e).__name__}: {e}"
            if log_errors:
                log.warning("profiling: %s not written: %s", name, out["errors"][name])
        except Exception as e:  # noqa: BLE001 - a bug here (an import included) must not
            out["errors"][name] = f"{type(e).__name__}: {e}"  # cost the run its summary
            if log_errors:
                log.warning("profiling: %s not written", name, exc_info=True)

    def report(path: str) -> str:
        from raytunix.profiling.report import render_report

        text, verdict = render_report(run_dir)
        out.update(
            report_text=text, bottleneck=verdict.resource, bottleneck_summary=verdict.summary
        )
        if verdict.learning is not None:
            out.update(
                learning_signal=verdict.learning.signal,
                learning_signal_summary=verdict.learning.summary,
            )
        with open(path, "w") as f:
            f.write(text)
        return path

    def trace(path: str) -> str:
        from raytunix.profiling.trace import write_trace

        return write_trace(run_dir, path)

    def plot(path: str) -> str:
        from raytunix.profiling.plots import write_plots

        return write_plots(run_dir, path)

    # Each maker imports its module itself, inside attempt's guard.
    attempt("report", report)
    attempt("trace", trace)
    attempt("plot", plot)
    return out
