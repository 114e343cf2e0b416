"""Plot time per scenario for weightsync, the floor and each baseline from benchmarks/results/*.json
(a run without baselines takes them from the run of the same scenario and model in results/baselines/).

Usage: python benchmarks/plot.py [results-dir] [out.png]   (needs matplotlib: pip install -e .[bench])
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(results: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    runs = [r for r in runs if not r.get("errors")]
    # a run of ours alone takes its baselines from the earlier run kept under results/baselines/
    earlier = {(b["scenario"], b["model"]): b["baselines"]
               for b in (json.loads(p.read_text()) for p in sorted((results / "baselines").glob("*.json")))}
    for r in runs:
        r["baselines"] = r.get("baselines") or earlier.get((r["scenario"], r["model"]), {})
    labels, seen = [], {}
    for r in runs:
        key = f"{r['scenario']}\n{r['model']}"
        seen[key] = seen.get(key, 0) + 1
        labels.append(key + (f"\nrun {seen[key]}" if seen[key] > 1 else ""))
    series = {"floor": [r["floor_seconds"] for r in runs], "weightsync": [r["median_seconds"] for r in runs]}
    for kind in ("naive", "bucketed", "checkpoint-engine"):
        series[kind] = [r.get("baselines", {}).get(kind, {}).get("median_seconds") for r in runs]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(runs)), 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + k * width for i, v in enumerate(values) if v is not None]
        ys = [v * 1e3 for v in values if v is not None]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(runs))], labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per sync (median, log scale)")
    ax.set_title("Time per weight sync on 2 x H200 (lower is better; a missing bar was not run)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    here = Path(__file__).parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "results", Path(sys.argv[2]) if len(sys.argv) > 2 else here / "plot.png")
