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
    for k, b in r.get("baselines", {}).items():
        s += (f"\n   {k}: {b['median_seconds'] * 1e3:.1f} ms ({b['speedup']:.2f}x) verified {b['verified']}" if b.get("ran")
              else f"\n   {k}: not run ({b.get('why')})")
    return s


for path in sys.argv[1:]:
    data = json.load(open(path))
    for r in data if isinstance(data, list) else [data]:
        print(line(r))
