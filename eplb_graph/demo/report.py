"""The demo's readable summary table and its PNG plot."""

from __future__ import annotations


def summary_table(report: dict) -> str:
    options = report["options"]
    latency = report["commit_latency_ms"]
    rows = [
        ("ranks / steps", f"{report['ranks']} / {report['steps']}"),
        ("model", (
            f"{options['layers']} layers x {options['experts']} experts "
            f"(+{options['redundant']} redundant), top-{options['top_k']}, "
            f"{options['weight_format']}"
        )),
        ("policy / window / interval", (
            f"{options['policy']} / {options['window_size']} / {options['step_interval']}"
        )),
        ("balancedness, EPLB on", f"{report['balancedness_eplb']:.4f}"),
        ("balancedness, EPLB off", f"{report['balancedness_baseline']:.4f}"),
        ("rearrangements (layers)", f"{report['rearrangements']} ({report['layers_committed']})"),
        ("bytes moved", f"{report['bytes_moved'] / 1e6:.2f} MB"),
        ("commit latency per layer", f"mean {latency['mean']:.3f} ms, max {latency['max']:.3f} ms"),
        ("recompiles after warm-up", str(report["recompiles"])),
        ("graph breaks", str(report["graph_breaks"])),
        ("max |EPLB on - EPLB off|", f"{report['max_abs_diff']:.3g}"),
        ("moved weights bit-exact", "yes" if report["weights_exact"] else "NO"),
        ("aborted rearrangements", str(report["aborted"])),
        ("wall time", f"{report['wall_seconds']:.1f} s (warm-up {report['warmup_seconds']:.1f} s)"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = ["eplb-graph demo", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Balancedness over time (EPLB on vs off) and per-rank load, rearrangements marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    commits = sorted({step for step, _ in report["commit_steps"]})
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.plot(series["step"], series["baseline"], color="0.6", label="EPLB off")
    top.plot(series["step"], series["eplb"], color="tab:blue", label="EPLB on")
    top.set_ylabel("balancedness")
    top.set_ylim(0, 1.02)
    top.legend(loc="lower right")
    top.set_title(
        f"eplb-graph demo: {report['ranks']} ranks, {report['options']['weight_format']}, "
        f"policy {report['options']['policy']}"
    )
    loads = list(zip(*series["rank_load"], strict=True)) if series["rank_load"] else []
    width = 9  # moving average: batch sizes vary step to step, the imbalance is what matters
    for rank, values in enumerate(loads):
        smooth = [
            sum(values[max(0, i - width + 1) : i + 1]) / (i + 1 - max(0, i - width + 1))
            for i in range(len(values))
        ]
        bottom.plot(series["step"], smooth, label=f"rank {rank}", linewidth=1.0)
    bottom.set_ylabel("rows computed per step, EPLB on\n(moving average of 9)")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right", fontsize="small", ncol=2)
    for axis in (top, bottom):
        for step in commits:
            axis.axvline(step, color="tab:red", alpha=0.15, linewidth=0.8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
