"""One line per bench result JSON: python3 benchmarks/summary.py FILE..."""

import json
import sys


def line(r: dict) -> str:
    if r.get("errors"):
        return f"{r['scenario']} {r['model']}: FAILED {r['errors']}"[:1500]
    s = (f"{r['scenario']} {r['model']}: median {r['median_seconds'] * 1e3:.1f} ms "
         f"[{r['min_seconds'] * 1e3:.1f}-{r['max_seconds'] * 1e3:.1f}] transfer {r.get('transfer_median_seconds', 0) * 1e3:.1f} ms "
         f"floor {r['floor_seconds'] * 1e3:.1f} eff {r['efficiency']:.2f} peak {r['peak_transient_bytes'] / 2**20:.0f} MiB "
         f"verified {r['verified']}")
    if r.get("pushed_bytes"):  # co-located across GPUs: what the workers wrote into each other
        s += f" pushed {r['pushed_bytes'] / 1e9:.2f} GB"
    if r.get("phase_median_seconds"):
        s += "\n   phases (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["phase_median_seconds"].items())
    for k, b in r.get("baselines", {}).items():
        if not b.get("ran") or "median_seconds" not in b:
            s += f"\n   {k}: not run ({b.get('why') or b.get('error')})"
            continue
        s += f"\n   {k}: {b['median_seconds'] * 1e3:.1f} ms ({b['speedup']:.2f}x) verified {b['verified']}"
        if "median_seconds_without_h2d" in b:
            s += f"; without H2D {b['median_seconds_without_h2d'] * 1e3:.1f} ms ({b['speedup_without_h2d']:.2f}x)"
    return s


for path in sys.argv[1:]:
    text = open(path).read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # NIXL/UCX lines share stdout with the result: take the lines that are results
        data = [json.loads(x) for x in text.splitlines() if x.startswith('{"scenario"')]
    for r in data if isinstance(data, list) else [data]:
        print(line(r))
