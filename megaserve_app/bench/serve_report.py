"""`megaserve bench serve`'s report: the rows as a Markdown table and as a 2x2 figure."""

from __future__ import annotations

import textwrap
from pathlib import Path


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| layout | conc | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| out tok/s | req/s | goodput req/s | SLO met | errors |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    body = "".join(
        f"| {r['layout']} | {r['concurrency']} | {r['requests']} | {r['ttft_p50_ms']:.0f} "
        f"| {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} "
        f"| {r['output_tok_s']:.1f} | {r['req_s']:.2f} | {r['goodput_req_s']:.2f} "
        f"| {100 * r['slo_met_fraction']:.0f}% | {r['errors']} |\n"
        for r in sorted(rows, key=lambda r: (r["layout"], r["concurrency"]))
    )
    return head + body


def plot(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """2x2: TTFT, ITL (p50 solid, p99 dashed), output tok/s, goodput (req/s dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0, 0], "TTFT (ms)", [("ttft_p50_ms", "-", "p50"), ("ttft_p99_ms", "--", "p99")]),
        (
            axes[0, 1],
            "inter-token latency (ms)",
            [("itl_p50_ms", "-", "p50"), ("itl_p99_ms", "--", "p99")],
        ),
        (axes[1, 0], "output tokens/s", [("output_tok_s", "-", "")]),
        (axes[1, 1], "requests/s", [("goodput_req_s", "-", "goodput"), ("req_s", ":", "all")]),
    ]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    colors = dict(zip(layouts, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
    for ax, ylabel, series in panels:
        for lay in layouts:
            rs = sorted((r for r in rows if r["layout"] == lay), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in rs]
            for key, style, label in series:
                ax.plot(
                    xs,
                    [r[key] for r in rs],
                    style,
                    marker="o",
                    color=colors[lay],
                    label=f"{lay} {label}".strip(),
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.set_ylabel(ylabel)
        if series[0][0].startswith(("ttft", "itl")):
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(textwrap.fill(title, 130), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
