"""Replay the steps bench_load recorded (bench_load_*_steps.json: each step's shape, device time
and the live model's prediction) through StepCostModel variants, offline: the one-step-ahead mean
relative error per probe, and how steady the fit's marginal prompt-token cost is (what SloBudget
divides by). The live model's own error is the `predicted_us` column.

    python3 bench/fit_cost_model.py bench/results/2026-12-02-load-h200-steps.json --forget 0.99,0.995
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.slo import PATHS, StepCostModel, StepShape


def replay(steps: list[list], forget: float, ridge: float) -> dict[int, dict[str, float]]:
    m = StepCostModel(forget=forget, ridge=ridge)
    per: dict[int, dict[str, list[float]]] = {}
    for probe, path, tokens, decodes, ctx, pairs, us, live_us in steps:
        shape = StepShape(tokens, decodes, ctx, pairs, PATHS[path])
        pred = m.predict_shape(shape) * 1e6
        d = per.setdefault(probe, {"err": [], "live": [], "tok": []})
        if m.observed >= 8:
            d["err"].append(abs(pred - us) / us)
            d["live"].append(abs(live_us - us) / us)
            d["tok"].append(m.per_token_s * 1e6)
        m.observe_shape(shape, us / 1e6)
    out = {}
    for probe, d in sorted(per.items()):
        tok = sorted(d["tok"]) or [0.0]
        out[probe] = {"steps": len(d["err"]), "err": statistics.fmean(d["err"]) if d["err"] else 0.0,
                      "live_err": statistics.fmean(d["live"]) if d["live"] else 0.0,
                      "tok_us_p5": tok[len(tok) // 20], "tok_us_p50": tok[len(tok) // 2], "tok_us_p95": tok[-1 - len(tok) // 20]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("steps", nargs="+")
    ap.add_argument("--forget", default="0.99")
    ap.add_argument("--ridge", default="1e-6")
    args = ap.parse_args()
    for f in args.steps:
        steps = json.loads(Path(f).read_text())["steps"]
        for forget in (float(x) for x in args.forget.split(",")):
            for ridge in (float(x) for x in args.ridge.split(",")):
                res = replay(steps, forget, ridge)
                worst = max(r["err"] for p, r in res.items() if p > 0)
                print(f"{Path(f).name} forget {forget} ridge {ridge}: worst probe err {worst:.3f}")
                for p, r in res.items():
                    print(f"  probe {p:2d}: {r['steps']:5d} steps, err {r['err']:.3f} (live {r['live_err']:.3f}), "
                          f"prompt token us p5/p50/p95 {r['tok_us_p5']:.1f}/{r['tok_us_p50']:.1f}/{r['tok_us_p95']:.1f}")


if __name__ == "__main__":
    main()
