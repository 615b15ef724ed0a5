"""The summary table that scripts/device.sh prints last (and writes to OUT/summary.md): each step with its exit
status, time and budget and a one-line result from its log, then the headline numbers of the JSON files the
steps wrote under OUT (benchmark.json, gpu_check.json, latency_summary.json), then the files that come back.

    python3 scripts/bench/summary.py --out DIR --mode MODE [--step 'name|rc|seconds|budget|log'] ...
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PYTEST_LINE = re.compile(r"^=*\s*((?:\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)"
                         r"(?:, )?)+(?: in [0-9.]+s.*?)?)\s*=*$")


def step_result(log: Path) -> str:
    """pytest's summary line (and the budget plugin's note) if the log has one, else its last line."""
    if not log.is_file():
        return "(no log)"
    lines = [ln.rstrip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    found = [m.group(1) for ln in lines if (m := PYTEST_LINE.match(ln.strip()))]
    budget = [ln.split("; not run:")[0].replace("pytest_budget: ", "") for ln in lines
              if ln.startswith("pytest_budget:")]
    if found:
        return found[-1] + (f" ({budget[-1]})" if budget else "")
    tail = [ln for ln in lines if not ln.startswith((" ", "}", "{", "]"))]
    return (tail or lines or ["(empty log)"])[-1][:110]


def rc_text(rc: str) -> str:
    return {"124": "124 (timeout)", "130": "130 (interrupted)", "137": "137 (killed)",
            "2": "2 (pytest: interrupted or usage)"}.get(rc, rc)


def fmt(v, spec=".1f", unit=""):
    return "-" if v is None else f"{v:{spec}}{unit}"


def benchmark_rows(path: Path) -> list[tuple[str, str]]:
    r = json.loads(path.read_text())
    rows = []
    done = [s for s in ("latency", "decode", "encoder", "throughput", "breakdown", "invariant", "coldstart") if s in r]
    failed = [s for s in done if isinstance(r[s], dict) and "error" in r[s]]
    rows.append((f"{path.parent.name}/{path.name}: sections",
                 ", ".join(done) + (f"; failed: {', '.join(failed)}" if failed else "")
                 + ("" if "total_s" in r else "; run cut short (no total_s)")))
    for row in r.get("latency", []) if isinstance(r.get("latency"), list) else []:
        if row.get("seconds") == 3.5:
            rows.append((f"latency 3.5 s clip, {row['new_tokens']} tokens: ours / transformers eager / compiled",
                         f"{fmt(row.get('ours_ms'))} / {fmt(row.get('hf_eager_ms'))} / "
                         f"{fmt(row.get('hf_compiled_ms'))} ms"))
    if isinstance(r.get("decode"), list) and r["decode"]:
        rows.append(("decode ms/token by context (batch 1)",
                     ", ".join(f"{d['context']}: {d['ms_per_token']:.3f}" for d in r["decode"])))
    if isinstance(r.get("encoder"), list):
        rows.append(("encoder ms/window by windows (ours / transformers eager)",
                     ", ".join(f"{e['windows']}: {e['ours_ms_per_window']:.2f} / "
                               f"{fmt(e.get('hf_eager_ms_per_window'), '.2f')}" for e in r["encoder"])))
    if isinstance(r.get("throughput"), list):
        rows.append(("throughput RTFx", ", ".join(f"{t['impl']}: {t['RTFx']:.0f}" for t in r["throughput"])))
    bd = r.get("breakdown")
    if isinstance(bd, dict) and "decode_step_graph_ms" in bd:
        rows.append(("decode step (graph) ms, batch 1 / batch 8 / batch 1 no PDL",
                     f"{fmt(bd['decode_step_graph_ms'].get('default'), '.3f')} / "
                     f"{fmt(bd['decode_step_graph_ms'].get('default, batch 8'), '.3f')} / "
                     f"{fmt(bd['decode_step_graph_ms'].get('no PDL'), '.3f')}"))
    if isinstance(r.get("invariant"), list):
        by_case = {}
        for row in r["invariant"]:
            by_case.setdefault(row["case"], {})[row["batch_invariant"]] = row
        for case, pair in by_case.items():
            def show(row):
                return "-" if row is None else (f"{row['ms']:.3f} ms" + (f" (RTFx {row['RTFx']:.0f})" if "RTFx" in row else ""))
            rows.append((f"batch invariant off / on: {case}", f"{show(pair.get(False))} / {show(pair.get(True))}"))
    cs = r.get("coldstart")
    if isinstance(cs, dict) and "cases" in cs:
        for c in cs["cases"]:
            verdict = {True: "meets", False: "misses", None: "?"}[c.get("meets_target")]
            rows.append((f"cold start, {c['case']}: total (import glmasr + load + warm-up + 1st request)",
                         f"{fmt(c.get('total_s'), '.2f', ' s')} ({verdict} <= {c.get('target_s')} s; process "
                         f"{fmt(c.get('process_wall_s'), '.1f', ' s')}, rc {c.get('rc')})"))
    return rows


def gpu_check_rows(path: Path) -> list[tuple[str, str]]:
    r = json.loads(path.read_text())
    rows = []
    for pair, c in (r.get("logits") or {}).items():
        rows.append((f"logits {pair}: max rel err, top-1",
                     f"{c['max_rel_err']:.4f}, {round(c['top1_agreement'] * c['positions'])}/{c['positions']}"))
    for name, c in (r.get("e2e_3.5s_13tok") or {}).items():
        rows.append((f"e2e 3.5 s / 13 tokens, {name}", f"{c['median_ms']:.1f} ms"))
    for d in r.get("decode_step_graph") or []:
        if d["batch"] == 1 and d["context"] == 64:
            rows.append(("decode step graph, batch 1, context 64", f"{d['step_ms']:.3f} ms"))
    for e in r.get("encoder") or []:
        rows.append((f"encoder {e['windows']} windows, ms/window Triton / torch",
                     f"{e['triton_ms_per_window']:.2f} / {e['torch_ms_per_window']:.2f}"))
    if r.get("errors"):
        rows.append(("gpu_check errors", "; ".join(f"{k}: {v[:80]}" for k, v in r["errors"].items())))
    return rows


def trace_rows(path: Path) -> list[tuple[str, str]]:
    r = json.loads(path.read_text())
    rows = [("traced latency, wall median", f"{r['wall_ms_median']:.2f} ms"),
            ("stage timings add up", str(r.get("stage_timings_add_up")))]
    for i, run in enumerate((r.get("gpu") or {}).get("runs", [])):
        rows.append((f"traced run {i}: kernel span / GPU busy / idle",
                     f"{run['kernel_span_ms']:.2f} / {run['gpu_busy_ms']:.2f} / {run['idle_ms']:.2f} ms"))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="?")
    ap.add_argument("--header", default="")
    ap.add_argument("--step", action="append", default=[], help="name|rc|seconds|budget|log")
    args = ap.parse_args()
    out = Path(args.out)
    lines = [f"## scripts/device.sh {args.mode}: summary", ""]
    if args.header:
        lines += [args.header, ""]
    lines += ["| step | rc | s | budget s | result |", "|---|---|---|---|---|"]
    for s in args.step:
        name, rc, secs, budget, log = (s.split("|") + [""] * 5)[:5]
        lines.append(f"| {name} | {rc_text(rc)} | {secs} | {budget} | {step_result(out / log) if log else ''} |")
    numbers, extra = [], []
    files = sorted(p for p in out.rglob("*") if p.is_file() and len(p.relative_to(out).parts) <= 3)
    for p in files:
        try:
            if p.name == "benchmark.json":
                numbers += benchmark_rows(p)
                table = (json.loads(p.read_text()).get("coldstart") or {}).get("table")
                if table:
                    extra += ["", f"cold start per stage ({p.parent.name}/{p.name}):", "", table]
            elif p.name == "gpu_check.json":
                numbers += gpu_check_rows(p)
            elif p.name == "latency_summary.json":
                numbers += trace_rows(p)
        except Exception as e:  # a cut-short or older JSON: say so, keep the rest
            numbers.append((p.name, f"unreadable: {e!r}"[:120]))
    if numbers:
        lines += ["", "| number | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in numbers]
    lines += extra
    files.append(out / "summary.md")
    lines += ["", f"files under OUT ({len(set(files))}; at most 8 come back): "
              + ", ".join(sorted({str(p.relative_to(out)) for p in files}))]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
