"""The demo's readable summary table and its PNG plot."""

from __future__ import annotations


def summary_table(report: dict) -> str:
    """The table rank 0 prints, every figure labelled with what it counts, and a takeaway."""
    options = report["options"]
    latency = report["commit_latency_ms"]
    steps = report["steps"]
    rows = [
        ("ranks / steps", f"{report['ranks']} / {steps}"),
        ("model", (
            f"{options['layers']} layers x {options['experts']} experts "
            f"(+{options['redundant']} redundant), top-{options['top_k']}, "
            f"{options['weight_format']}"
        )),
        ("policy / window / interval", (
            f"{options['policy']} / {options['window_size']} / {options['step_interval']} steps"
        )),
        *_timing_rows(report.get("step_time")),
        ("balancedness of rows, on / off", (
            f"{report['balancedness_eplb']:.4f} / {report['balancedness_baseline']:.4f}  (mean "
            f"over the {steps} steps of mean / max rows per rank, same traffic; what the policy "
            "evens, a means to the row above)"
        )),
        ("rearrangements completed", (
            f"{report['rearrangements']} ({report['layers_committed']} layers committed)"
        )),
        ("expert weights moved", f"{report['bytes_moved'] / 1e6:.2f} MB, received by all ranks"),
        ("commit latency per layer", (
            f"mean {latency['mean']:.3f} ms, max {latency['max']:.3f} ms (serving thread)"
        )),
        ("recompiles after warm-up", str(report["recompiles"])),
        ("graph breaks", str(report["graph_breaks"])),
        ("max |EPLB on - EPLB off|", f"{report['max_abs_diff']:.3g}  (model outputs, every step)"),
        ("moved weights bit-exact", "yes" if report["weights_exact"] else "NO"),
        ("aborted rearrangements", str(report["aborted"])),
        ("wall time", f"{report['wall_seconds']:.1f} s (warm-up {report['warmup_seconds']:.1f} s)"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = ["eplb-graph demo", "-" * (width + 60)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    lines += ["", takeaway(report)]
    return "\n".join(lines)


def _timing_rows(timing: dict | None) -> list[tuple[str, str]]:
    """The measured-time rows; a run without timings has none of them, so one check says so."""
    rows = (
        ("step time, EPLB on / off", _step_row),
        ("busiest rank's expert time", _expert_row),
        ("balancedness of expert time", _measured_row),
    )
    return [(name, row(timing) if timing else "not measured") for name, row in rows]


def _step_row(timing: dict) -> str:
    return (
        f"{timing['eplb']['step_ms']:.2f} / {timing['baseline']['step_ms']:.2f} ms  (median "
        "forward of the slowest rank, dispatch and combine included)"
    )


def _expert_row(timing: dict) -> str:
    return (
        f"on {timing['eplb']['busiest_expert_ms']:.3f} ms, off "
        f"{timing['baseline']['busiest_expert_ms']:.3f} ms per step  (median, the expert op's "
        "own clock)"
    )


def _measured_row(timing: dict) -> str:
    values = [timing[name]["balancedness_measured"] for name in ("eplb", "baseline")]
    on, off = ("n/a" if v is None else f"{v:.4f}" for v in values)
    return (
        f"on {on}, off {off}  (mean / max over ranks of measured expert time: what a step "
        "waits for; 1 = every rank equally busy)"
    )


def speed_effect(report: dict) -> str:
    """What the measured times say: faster, not faster, or not measured."""
    timing = report.get("step_time")
    if not timing or timing.get("step_speedup") is None:
        return "step time not measured"
    step, expert = timing["step_speedup"], timing.get("expert_speedup")
    expert_text = "" if expert is None else f", the busiest rank's expert time {expert:.2f}x"
    if step >= 1.02:
        return f"steps ran {step:.2f}x faster than EPLB off{expert_text}"
    return (
        f"steps were not faster than EPLB off ({step:.2f}x{expert_text}: at this model size "
        "dispatch and combine, not experts, dominate a step)"
    )


def takeaway(report: dict) -> str:
    """One sentence: what EPLB changed in this run, and what it did not break."""
    on, off = report["balancedness_eplb"], report["balancedness_baseline"]
    if report["rearrangements"] == 0:
        effect = f"EPLB made no rearrangement (balancedness {on:.2f}, off {off:.2f})"
    elif on > off:
        effect = (
            f"EPLB raised balancedness from {off:.2f} to {on:.2f} (the busiest rank's load "
            f"fell {1 - off / on:.0%}) with {report['rearrangements']} rearrangements "
            f"moving {report['bytes_moved'] / 1e6:.1f} MB while serving went on"
        )
    else:
        effect = f"EPLB did not raise balancedness here ({on:.2f} against {off:.2f} off)"
    exact = report["max_abs_diff"] == 0 and report["weights_exact"]
    outputs = "outputs identical to EPLB off" if exact else "OUTPUTS DIFFER from EPLB off"
    return (
        f"Takeaway: {effect}; {speed_effect(report)}; {report['recompiles']} recompiles, "
        f"{report['graph_breaks']} graph breaks, {outputs}."
    )


def plot(report: dict, path: str) -> None:
    """Balancedness over time (EPLB on vs off), and rows computed per rank with EPLB off and on,
    layer commits marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    commits = sorted({step for step, _ in report["commit_steps"]})
    per_rank = [("EPLB on", series["rank_load"])]
    if series.get("rank_load_baseline"):
        per_rank.insert(0, ("EPLB off", series["rank_load_baseline"]))
    figure, axes = plt.subplots(
        1 + len(per_rank), 1, figsize=(10, 3.2 * (1 + len(per_rank))), sharex=True
    )
    top = axes[0]
    top.plot(series["step"], series["baseline"], color="0.6", label="EPLB off")
    top.plot(series["step"], series["eplb"], color="tab:blue", label="EPLB on")
    top.set_ylabel("balancedness\n(mean / max rank load,\n1 = every rank equally busy)")
    top.set_ylim(0, 1.02)
    top.set_title(
        f"eplb-graph demo: {report['ranks']} ranks, {report['options']['weight_format']}, "
        f"policy {report['options']['policy']}; mean balancedness "
        f"{report['balancedness_eplb']:.2f} on, {report['balancedness_baseline']:.2f} off"
    )
    width = 9  # moving average: batch sizes vary step to step, the imbalance is what matters
    peak = 0.0
    for axis, (label, rows) in zip(axes[1:], per_rank, strict=True):
        for rank, values in enumerate(zip(*rows, strict=True)):
            smooth = [
                sum(values[max(0, i - width + 1) : i + 1]) / (i + 1 - max(0, i - width + 1))
                for i in range(len(values))
            ]
            peak = max(peak, max(smooth, default=0.0))
            axis.plot(series["step"], smooth, label=f"rank {rank}", linewidth=1.0)
        axis.set_ylabel(f"{label}:\nrows computed per rank\n(moving average of {width} steps)")
        axis.legend(loc="upper right", fontsize="small", ncol=2)
    for axis in axes[1:]:
        axis.set_ylim(0, 1.05 * peak if peak else 1)  # one scale: off and on compare directly
    axes[-1].set_xlabel("serving step")
    for axis in axes:
        for index, step in enumerate(commits):
            label = "layer commit" if index == 0 and axis is top else None
            axis.axvline(step, color="tab:red", alpha=0.2, linewidth=0.8, label=label)
    top.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
