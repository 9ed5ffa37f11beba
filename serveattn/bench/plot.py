"""Charts of benchmark results: one PNG per family, from a run's JSON (``--json``) or right after a run (``--plot``).

``python -m serveattn.bench plot JSON [JSON ...] [--out docs/plots]`` plots saved files;
``plot_result(result, out_dir)`` plots one result, either a whole payload (what ``--json`` writes: ``command``,
``environment``, ``ceilings``, ``families``) or one family's result dict.

- prefill: TFLOP/s per case of ours (paged, ragged) and each peer, with the matrix ceiling of that run.
- decode: K/V TB/s per case of our variants (CUDA-core / tensor-core, eager / CUDA graph) and each peer, with the
  copy ceiling of that run and the issue's per-case TB/s targets.
- fp8: fp8/bf16 speed (bf16 time / fp8 time) per decode case and variant with the 1.8x target; prefill TFLOP/s of
  fp8 vs bf16 (and kv8) vs cuDNN, with the bf16 and fp8 ceilings.
- verify: time of k rows per request over the best k = 1 (eager and CUDA graph) with the 1.10x target at k = 4,
  the trees at their node count; and the times in ms of ours and the peers per case.

Files are ``<out_dir>/<family>.png`` (deterministic). matplotlib is imported only when a chart is drawn, with
the non-interactive Agg backend; nothing here needs torch, Triton or a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from typing import Callable, Dict, List, Optional, Sequence, Tuple

MISSING = ("plotting needs matplotlib, which is not installed in this Python ({python}); install it "
           "(pip install matplotlib) or leave out --plot: the numbers and the JSON do not need it.")

#: Colours: ours solid, blues then greens (a darker and a lighter shade: eager, then CUDA graph); peers warm, hatched.
OURS_COLORS = ("#1f77b4", "#aec7e8", "#2ca02c", "#98df8a", "#9467bd", "#c5b0d5", "#17becf", "#9edae5")
PEER_COLORS = ("#ff7f0e", "#d62728", "#8c564b", "#7f7f7f", "#e377c2", "#bcbd22", "#ffbb78", "#ff9896")
TIMED = ("ok", "unchecked")
DPI = 120


def require_matplotlib():
    """Imports matplotlib with the Agg backend and returns the module; ImportError with one sentence if missing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING.format(python=sys.executable)) from None
    if "matplotlib.pyplot" not in sys.modules:  # never switch the backend under someone's open pyplot figures
        matplotlib.use("Agg")
    return matplotlib


def _figure(width: float, height: float, rows: int = 1, cols: int = 1):
    """A Figure on an Agg canvas (no pyplot: no global figure state, nothing interactive)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    try:
        fig = Figure(figsize=(width, height), layout="constrained")
    except TypeError:  # matplotlib < 3.5
        fig = Figure(figsize=(width, height), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [a for row in axes for a in row]


# ---------------------------------------------------------------- context: title, values

def _context(payload: dict) -> dict:
    env = payload.get("environment") or {}
    date = str(env.get("date_utc") or "date unknown")
    if "T" in date:
        date = date.replace("T", " ")[:16] + (" UTC" if date.endswith("+00:00") else "")
    device = env.get("device") or "GPU unknown"
    if env.get("capability"):
        device += f" (sm {env['capability']})"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton") if env.get(k))
    command = payload.get("command")
    command = shlex.join(str(c) for c in command) if isinstance(command, list) else (command or "command unknown")
    return {"device": device, "date": date, "versions": versions, "command": command,
            "ceilings": payload.get("ceilings") or {}}


def _title(fig, what: str, ctx: dict, source: Optional[str]) -> None:
    head = f"{what}\n{ctx['device']}, {ctx['date']}" + (f"; {ctx['versions']}" if ctx["versions"] else "")
    cmd = textwrap.fill("command: " + ctx["command"], 140, subsequent_indent="    ")
    fig.suptitle(f"{head}\n{cmd}" + (f"\ndata: {source}" if source else ""), fontsize=9)


def _ms(r: Optional[dict]) -> Optional[float]:
    return r.get("ms") if r and r.get("status") in TIMED and r.get("ms") else None


def _val(r: Optional[dict], metric: str) -> Optional[float]:
    return r.get(metric) if _ms(r) and r.get(metric) is not None else None


def _best_ms(runners: dict, keys: Sequence[str]) -> Optional[Tuple[str, float]]:
    got = [(k, _ms(runners.get(k))) for k in keys if _ms(runners.get(k))]
    return min(got, key=lambda kv: kv[1]) if got else None


def _ratio(slow: Optional[float], fast: Optional[float]) -> Optional[float]:
    return slow / fast if slow and fast else None


def _source_word(ceilings: dict, key: str) -> str:
    """'default' or 'measured' for the ceiling ``key`` of a run."""
    src = (ceilings.get("source") or {}).get(key, "")
    return src.split(" (")[0].split(":")[0] or "default"


# ---------------------------------------------------------------- drawing helpers

class Series:
    """One bar per case: a label, a value per case (None: not timed), whether it is ours, and the runner of each
    case where there is one (its status is written where the bar is missing; '' where the case did not run it)."""

    def __init__(self, label: str, values: Sequence[Optional[float]], ours: bool,
                 runners: Optional[Sequence[Optional[dict]]] = None):
        self.label, self.values, self.ours = label, list(values), ours
        self.runners = list(runners) if runners is not None else [None] * len(self.values)
        self.missing = ["" if r is None else (r.get("status") or "n/a") if r.get("status") not in TIMED
                        else "no time" for r in self.runners]

    def reason(self) -> str:
        """The first reason any of its runners gives for not being timed."""
        return next((str(r["reason"]) for r in self.runners if r and r.get("reason")), "not timed")


def _split_untimed(series: Sequence[Series]) -> Tuple[List[Series], str]:
    """(the series with at least one value, a note naming the others and why, '' when there are none): a runner
    that was never timed (say FlashInfer not installed) would only be a row of 'failed' marks."""
    kept = [s for s in series if any(v is not None for v in s.values)]
    why: Dict[str, List[str]] = {}
    for s in series:
        if s not in kept:
            r = s.reason()
            why.setdefault(r if len(r) <= 90 else r[:87] + "...", []).append(s.label)
    return kept, "; ".join(f"{', '.join(labels)}: {r}" for r, labels in why.items())


def _runner_series(cases: Sequence[dict], metric: str, keys: Optional[Sequence[str]] = None,
                   labels: Optional[Dict[str, str]] = None) -> List[Series]:
    """A series per runner key (ours first, in order of appearance), ``metric`` of each case's runner."""
    if keys is None:
        seen: List[str] = []
        for c in cases:
            seen += [k for k in c.get("runners", {}) if k not in seen]
        ours = [k for k in seen if any(c["runners"].get(k, {}).get("ours") for c in cases)]
        keys = ours + [k for k in seen if k not in ours]
    out = []
    for k in keys:
        rs = [c.get("runners", {}).get(k) for c in cases]
        if not any(rs):
            continue
        title = (labels or {}).get(k) or next((r.get("title") for r in rs if r and r.get("title")), k)
        ours = any(r.get("ours") for r in rs if r)
        out.append(Series(title, [_val(r, metric) for r in rs], ours, rs))
    return out


def _bars(ax, case_labels: Sequence[str], series: Sequence[Series], value_fmt: str, ylabel: str) -> dict:
    """Grouped bars: a group per case, a bar per series, the value over each bar; 'failed' etc. where not timed.
    A series with no value in any case gets no bars, only a line in the top left corner saying why.
    Returns {case index: (left, right)} x extents of the groups (for per-case target marks)."""
    series, note = _split_untimed(series)
    ax._serveattn_note_lines = 0
    if note:
        fig = ax.get_figure()
        chars = max(40, int(fig.get_figwidth() * ax.get_position().width * 17))
        text = textwrap.fill("not timed in any case: " + note, chars)
        ax._serveattn_note_lines = text.count("\n") + 1
        ax.text(0.005, 0.99, text, transform=ax.transAxes, ha="left", va="top", fontsize=6.5, color="#aa0000")
    n, m = len(case_labels), max(1, len(series))
    width = 0.84 / m
    oi = pi = 0
    top = max([v for s in series for v in s.values if v is not None] or [1.0])
    fs = 7 if m <= 4 else 6
    for j, s in enumerate(series):
        if s.ours:
            color, hatch = OURS_COLORS[oi % len(OURS_COLORS)], None
            oi += 1
        else:
            color, hatch = PEER_COLORS[pi % len(PEER_COLORS)], "//"
            pi += 1
        xs = [i - 0.42 + width * (j + 0.5) for i in range(n)]
        hs = [v if v is not None else 0.0 for v in s.values]
        ax.bar(xs, hs, width * 0.92, color=color, hatch=hatch, edgecolor="#333333" if hatch else color,
               linewidth=0.4, label=s.label + ("" if s.ours else " (peer)"))
        for x, v, why in zip(xs, s.values, s.missing):
            if v is None:
                if why:
                    ax.text(x, top * 0.01, why, rotation=90, ha="center", va="bottom", fontsize=fs, color="#aa0000")
            else:
                ax.text(x, v + top * 0.01, format(v, value_fmt), rotation=90, ha="center", va="bottom", fontsize=fs)
    ax.set_xticks(range(n))
    ax.set_xticklabels(case_labels, fontsize=8)
    ax.set_xlim(-0.55, n - 0.45)
    ax.set_ylabel(ylabel, fontsize=8.5)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    return {i: (i - 0.42, i + 0.42) for i in range(n)}


def _hline(ax, y: float, text: str, color: str = "black", style: str = "--") -> None:
    ax.axhline(y, color=color, linestyle=style, linewidth=1.1, label=text)


def _case_marks(ax, extents: dict, values: Dict[int, float], label: str, color: str = "#d62728") -> None:
    """A short horizontal segment over the group of each case that has a value (a per-case target)."""
    first = True
    for i, y in sorted(values.items()):
        lo, hi = extents[i]
        ax.plot([lo, hi], [y, y], color=color, linestyle=(0, (3, 1.5)), linewidth=1.6,
                label=label if first else None)
        ax.text(hi, y, f" {y:g}", ha="left", va="center", fontsize=7, color=color)
        first = False


def _finish(fig, ax, top: float, legend_cols: int = 4) -> None:
    ax.set_ylim(0, top * (1.18 + 0.05 * getattr(ax, "_serveattn_note_lines", 0)))
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=legend_cols,
                  fontsize=7.5, frameon=False)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return path


def _top(series: Sequence[Series], *extra: Optional[float]) -> float:
    vals = [v for s in series for v in s.values if v is not None] + [e for e in extra if e]
    return max(vals or [1.0])


# ---------------------------------------------------------------- families

def _prefill(fam: dict, ctx: dict, path: str, source: Optional[str]) -> str:
    cases = fam.get("cases") or []
    cfg = fam.get("config") or {}
    ceil = ctx["ceilings"]
    fp8 = "fp8" in str(cfg.get("dtype", "")) or "float8" in str(cfg.get("dtype", ""))
    rate_key = "fp8_flops" if fp8 else "bf16_flops"
    rate = ceil.get(rate_key)
    series = _runner_series(cases, "tflops")
    fig, (ax,) = _figure(max(8.0, 1.0 + 0.42 * len(cases) * max(1, len(series))), 5.6)
    labels = [f"{c['name']}\n({sum(c.get('seq_lens') or [])} tokens)" if c.get("seq_lens") else c["name"]
              for c in cases]
    _bars(ax, labels, series, ".0f", "TFLOP/s (causal flops, FlashInfer convention)")
    if rate:
        _hline(ax, rate / 1e12, f"{'fp8' if fp8 else 'bf16'} matrix ceiling {rate / 1e12:.0f} TFLOP/s "
                                f"({_source_word(ceil, 'fp8_rate' if fp8 else 'bf16_rate')})")
    _finish(fig, ax, _top(series, rate and rate / 1e12), legend_cols=4)
    ax.set_title(f"causal prefill: GQA {cfg.get('num_qo_heads', '?')}/{cfg.get('num_kv_heads', '?')}, head dim "
                 f"{cfg.get('head_dim', '?')}, {cfg.get('dtype', '')}, page {cfg.get('page_size', '?')}; "
                 f"bars: our wrappers (solid) and peers (hatched); higher is better", fontsize=8.5)
    _title(fig, "serveattn.bench prefill: TFLOP/s against the matrix ceiling", ctx, source)
    return _save(fig, path)


def _decode(fam: dict, ctx: dict, path: str, source: Optional[str]) -> str:
    cases = fam.get("cases") or []
    cfg = fam.get("config") or {}
    bw = ctx["ceilings"].get("bandwidth_Bps")
    series = _runner_series(cases, "tbps")
    fig, (ax,) = _figure(max(8.0, 1.0 + 0.36 * len(cases) * max(1, len(series))), 5.6)
    ext = _bars(ax, [c["name"].replace("x", " x ") for c in cases], series, ".2f",
                "K/V TB/s (K/V bytes read / time)")
    ax.set_xlabel("batch x KV length", fontsize=8.5)
    if bw:
        _hline(ax, bw / 1e12, f"copy ceiling {bw / 1e12:.2f} TB/s ({_source_word(ctx['ceilings'], 'bandwidth')})")
    targets = cfg.get("targets_tbps") or {}
    marks = {i: float(targets[c["name"]]) for i, c in enumerate(cases) if c["name"] in targets}
    if marks:
        _case_marks(ax, ext, marks, "issue target, TB/s of our best variant")
    _finish(fig, ax, _top(series, bw and bw / 1e12, *marks.values()), legend_cols=4)
    ax.set_title(f"batch decode (batch x KV length): GQA {cfg.get('num_qo_heads', '?')}/"
                 f"{cfg.get('num_kv_heads', '?')}, head dim {cfg.get('head_dim', '?')}, {cfg.get('dtype', '')}, "
                 f"page {cfg.get('page_size', '?')}, shuffled pages; ours solid, peers hatched; higher is better",
                 fontsize=8.5)
    _title(fig, "serveattn.bench decode: K/V TB/s against the copy ceiling", ctx, source)
    return _save(fig, path)


#: fp8 decode variants: bf16 key -> label (the fp8 key has an 8 after the first two letters).
FP8_VARIANTS = (("cc", "CUDA-core, eager"), ("cc-graph", "CUDA-core, CUDA graph"), ("tc", "tensor-core, eager"),
                ("tc-graph", "tensor-core, CUDA graph"))


def _fp8(fam: dict, ctx: dict, path: str, source: Optional[str]) -> str:
    cfg = fam.get("config") or {}
    ceil = ctx["ceilings"]
    dec = (fam.get("decode") or {}).get("cases") or []
    pre = (fam.get("prefill") or {}).get("cases") or []
    panels = [p for p, cs in (("decode", dec), ("prefill", pre)) if cs]
    if not panels:
        raise ValueError("fp8 result has neither decode nor prefill cases")
    fig, axes = _figure(12.0, 5.2 * len(panels), rows=len(panels))
    ax_of = dict(zip(panels, axes))
    if dec:
        ax = ax_of["decode"]
        series = []
        for v, label in FP8_VARIANTS:
            f = v[:2] + "8" + v[2:]
            vals = [_ratio(_ms(c["runners"].get(v)), _ms(c["runners"].get(f))) for c in dec]
            if any(c["runners"].get(v) or c["runners"].get(f) for c in dec):
                series.append(Series(label, vals, True))
        best = [_ratio((_best_ms(c["runners"], [v for v, _ in FP8_VARIANTS]) or (0, None))[1],
                       (_best_ms(c["runners"], [v[:2] + "8" + v[2:] for v, _ in FP8_VARIANTS]) or (0, None))[1])
                for c in dec]
        series.append(Series("best bf16 / best fp8", best, True))
        _bars(ax, [c["name"].replace("x", " x ") for c in dec], series, ".2f",
              "fp8/bf16 speed (bf16 ms / fp8 ms)")
        goals = cfg.get("decode_targets") or {}
        for g in sorted(set(goals.values())):
            where = ", ".join(k for k, x in goals.items() if x == g)
            _hline(ax, g, f"target fp8/bf16 >= {g:g}x ({where})", color="#d62728")
        _hline(ax, 1.0, "parity (1x)", color="#777777", style=":")
        _finish(fig, ax, _top(series, *goals.values()), legend_cols=4)
        ax.set_title("decode (batch x KV length), fp8 e4m3 KV cache vs our bf16 decode on the same (dequantized) "
                     "data, per variant; above 1: fp8 faster", fontsize=8.5)
    if pre:
        ax = ax_of["prefill"]
        labels = {"fp8": "ours fp8 q + KV", "kv8": "ours bf16 q, fp8 KV (kv8)", "bf16": "ours bf16",
                  "cudnn": "cuDNN SDPA", "flash": "torch flash SDPA"}
        keys = [k for k in ("fp8", "kv8", "bf16") if any(k in c["runners"] for c in pre)]
        keys += [k for k in (cfg.get("peers") or []) if any(k in c["runners"] for c in pre)]
        keys += [k for c in pre for k in c["runners"] if k not in keys]
        keys = list(dict.fromkeys(keys))
        series = _runner_series(pre, "tflops", keys=keys, labels=labels)
        ext = _bars(ax, [c["name"] for c in pre], series, ".0f", "TFLOP/s (causal flops)")
        lines = []
        for key, name in (("bf16_flops", "bf16"), ("fp8_flops", "fp8")):
            if ceil.get(key):
                lines.append(ceil[key] / 1e12)
                _hline(ax, ceil[key] / 1e12, f"{name} matrix ceiling {ceil[key] / 1e12:.0f} TFLOP/s "
                                             f"({_source_word(ceil, key.replace('_flops', '_rate'))})",
                       color="black" if name == "bf16" else "#555555", style="--" if name == "bf16" else "-.")
        fi = cfg.get("fi_fa3_fp8_baseline_tflops") or {}
        marks = {i: float(fi[c["name"]]) for i, c in enumerate(pre) if c["name"] in fi}
        if marks:
            _case_marks(ax, ext, marks, "FlashInfer fa3 fp8 (baseline run, not measured here)", color="#9467bd")
        _finish(fig, ax, _top(series, *lines, *marks.values()), legend_cols=4)
        ax.set_title("causal prefill: fp8 (e4m3, per-tensor scales) vs our bf16 on the dequantized inputs vs the "
                     "peers; higher is better", fontsize=8.5)
    _title(fig, "serveattn.bench fp8: fp8/bf16 decode speed and prefill TFLOP/s", ctx, source)
    return _save(fig, path)


def _verify(fam: dict, ctx: dict, path: str, source: Optional[str]) -> str:
    cfg = fam.get("config") or {}
    cases = fam.get("cases") or []
    by = {c["name"]: c for c in cases}
    forms = {"eager": ("cc", "tc"), "graph": ("cc-graph", "tc-graph")}
    k1 = by.get("k=1")
    base = {f: _best_ms(k1["runners"], keys) if k1 else None for f, keys in forms.items()}
    target = cfg.get("target") or {}
    fig, (ax, bx) = _figure(14.0, 5.4, cols=2)

    chains = sorted((c for c in cases if c.get("kind") == "chain"), key=lambda c: c["rows_per_request"])
    trees = [c for c in cases if c.get("kind") == "tree"]
    colors = {"eager": "#1f77b4", "graph": "#2ca02c"}

    def over_k1(case: Optional[dict], form: str) -> Optional[float]:
        t = _best_ms(case["runners"], forms[form]) if case else None
        return t[1] / base[form][1] if t and base[form] else None

    top = 1.0
    chain_pts = {form: [(c["rows_per_request"], over_k1(c, form)) for c in chains] for form in forms}
    for form in forms:
        pts = [(k, y) for k, y in chain_pts[form] if y is not None]
        if not pts:
            continue
        b = base[form]
        ax.plot([k for k, _ in pts], [y for _, y in pts], marker="o", color=colors[form], linewidth=1.4,
                label=f"chain, {form} (over k=1 {b[0]}, {b[1]:.4f} ms)")
        other = dict(chain_pts["graph" if form == "eager" else "eager"])
        for k, y in pts:  # the higher of the two forms labelled above its point, the lower below
            above = other.get(k) is None or y > other[k] or (y == other[k] and form == "eager")
            ax.annotate(f"{y:.2f}", (k, y), textcoords="offset points", xytext=(0, 6 if above else -12),
                        ha="center", fontsize=7, color=colors[form])
        top = max(top, *[y for _, y in pts])
    for form in forms:
        tpts = [(c, over_k1(c, form)) for c in trees]
        tpts = [(c, y) for c, y in tpts if y is not None]
        if tpts:
            ax.scatter([c["rows_per_request"] for c, _ in tpts], [y for _, y in tpts], marker="*", s=120,
                       color=colors[form], edgecolor="black", linewidth=0.5, zorder=5,
                       label=f"tree, {form} (at its node count)")
            top = max(top, *[y for _, y in tpts])
    lines = []
    for c in trees:
        ys = [y for y in (over_k1(c, f) for f in forms) if y is not None]
        if ys:
            ax.annotate(c["name"], (c["rows_per_request"], max(ys)), textcoords="offset points", xytext=(-10, 8),
                        ha="right", fontsize=7.5, fontweight="bold")
        parts = []
        for what, k in (("k=1", 1), (f"chain k={c.get('depth')} (same depth)", c.get("depth")),
                        (f"chain k={c['rows_per_request']} (same nodes)", c["rows_per_request"])):
            vals = []
            for form in forms:
                t = _best_ms(c["runners"], forms[form])
                ref = base[form] if k == 1 else _best_ms((by.get(f"k={k}") or {}).get("runners", {}), forms[form])
                vals.append(f"{form} {t[1] / ref[1]:.2f}x" if t and ref else f"{form} -")
            parts.append(f"/ {what}: " + ", ".join(vals))
        lines.append(f"{c['name']} ({c['rows_per_request']} nodes, depth {c.get('depth')}):\n  " + "\n  ".join(parts))
    if lines:
        ax.text(0.99, 0.02, "\n".join(lines), transform=ax.transAxes, ha="right", va="bottom", fontsize=6.8,
                family="monospace", multialignment="left",
                bbox={"facecolor": "white", "edgecolor": "#bbbbbb", "alpha": 0.9})
    if target.get("max_ratio"):
        _hline(ax, float(target["max_ratio"]), f"target: k={target.get('k')} <= {target['max_ratio']:.2f}x of k=1",
               color="#d62728")
        if target.get("k"):
            ax.axvline(float(target["k"]), color="#d62728", linestyle=":", linewidth=0.9)
    ks = sorted({c["rows_per_request"] for c in chains + trees})
    if ks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks], fontsize=8)
        ax.minorticks_off()
    ax.set_xlabel("rows per request (chain k = q_len_per_req; tree: nodes)", fontsize=8.5)
    ax.set_ylabel("time / best k=1 of ours in the same form", fontsize=8.5)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(color="#dddddd", linewidth=0.6)
    ax.set_ylim(0, top * 1.15)
    ax.legend(loc="upper left", fontsize=7.5, frameon=False)
    ax.set_title(f"cost of k rows per request against k=1 (batch {cfg.get('batch', '?')}, KV {cfg.get('kv_len', '?')}"
                 f" per request); lower is better", fontsize=8.5)

    # right: the times themselves, ours (best of the form) and the peers, per case
    series = []
    for form, keys in forms.items():
        vals = [(_best_ms(c["runners"], keys) or (None, None))[1] for c in cases]
        if any(vals):
            series.append(Series(f"ours, {form}", vals, True))
    peers = []
    for c in cases:
        peers += [k for k, r in c["runners"].items() if not r.get("ours") and k not in peers]
    for p in peers:
        rs = [c["runners"].get(p) for c in cases]
        title = next((r["title"].split(" [")[0] for r in rs if r and r.get("title")), p)
        series.append(Series(title, [_ms(r) for r in rs], False, rs))
    _bars(bx, [c["name"] for c in cases], series, ".3f", "ms (lower is better)")
    _finish(fig, bx, _top(series), legend_cols=3)
    bx.set_title("time per call: ours (the best of cc / tc in each form) and the peers (eager only)", fontsize=8.5)
    _title(fig, "serveattn.bench verify: speculative verify, k rows per request against k=1", ctx, source)
    return _save(fig, path)


#: family -> drawing function(family result, context, path, source) -> path.
PLOTTERS: Dict[str, Callable[[dict, dict, str, Optional[str]], str]] = {
    "prefill": _prefill, "decode": _decode, "fp8": _fp8, "verify": _verify}


# ---------------------------------------------------------------- entry points

def _families(result: dict) -> Tuple[dict, dict]:
    """(context payload, {family: family result}) of a whole payload or of one family's result."""
    if "families" in result:
        return result, dict(result["families"])
    if "family" in result:
        return result, {result["family"]: result}
    raise ValueError("not a serveattn.bench result: neither 'families' (a --json file) nor 'family' (one family)")


def plot_result(result: dict, out_dir, source: Optional[str] = None, suffix: str = "",
                log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> List[str]:
    """Draws one PNG per family of ``result`` into ``out_dir`` as ``<family><suffix>.png``; returns the paths.

    ``result``: a whole ``--json`` payload (command, environment, ceilings, families) or one family's result.
    A family without a chart here, or one that failed before any case, is skipped with a line to ``log``.
    ``source``: where the numbers came from, written in the corner of each chart.
    """
    require_matplotlib()
    payload, fams = _families(result)
    ctx = _context(payload)
    paths = []
    for name, fam in fams.items():
        draw = PLOTTERS.get(name)
        if draw is None:
            log(f"plot: no chart for family {name!r} (charts: {', '.join(PLOTTERS)}); skipped")
            continue
        if not (fam.get("cases") or any((fam.get(p) or {}).get("cases") for p in ("decode", "prefill"))):
            log(f"plot: {name} has no cases ({fam.get('error') or 'nothing measured'}); skipped")
            continue
        paths.append(draw(fam, ctx, os.path.join(str(out_dir), f"{name}{suffix}.png"), source))
    return paths


def plot_files(files: Sequence[str], out_dir, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)
               ) -> List[str]:
    """Plots saved JSON files into ``out_dir``. Charts are ``<family>.png``; a family found in more than one file
    gets ``<family>-<file name without .json>.png`` for each, so that no chart overwrites another."""
    loaded = []
    for f in files:
        try:
            with open(f) as fh:
                loaded.append((f, json.load(fh)))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"plot: cannot read {f}: {exc}") from None
    count: Dict[str, int] = {}
    for _, data in loaded:
        for name in _families(data)[1]:
            count[name] = count.get(name, 0) + 1
    paths = []
    for f, data in loaded:
        stem = os.path.splitext(os.path.basename(f))[0]
        for name, fam in _families(data)[1].items():
            one = {k: v for k, v in data.items() if k != "families"} if "families" in data else {}
            one = dict(one, families={name: fam}) if "families" in data else fam
            paths += plot_result(one, out_dir, source=f, suffix=f"-{stem}" if count[name] > 1 else "", log=log)
    return paths


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``plot`` subcommand on the subparsers of ``python -m serveattn.bench``."""
    help_ = "draw PNG charts (one per family) from saved --json files; needs matplotlib, no GPU"
    p = sub.add_parser("plot", help=help_, description=help_ + ". Charts: " + "; ".join([
        "prefill: TFLOP/s vs the matrix ceiling", "decode: K/V TB/s vs the copy ceiling",
        "fp8: fp8/bf16 decode speed vs the 1.8x target, prefill TFLOP/s", "verify: time over k=1 vs the 1.10x target"])
        + ". Files: DIR/<family>.png (<family>-<json name>.png when several files hold the same family).")
    p.add_argument("json_files", nargs="+", metavar="JSON", help="result files written by --json")
    p.add_argument("--out", default=os.path.join("docs", "plots"), metavar="DIR",
                   help="directory for the PNG files (default docs/plots)")
    return p


def main(args) -> int:
    """``python -m serveattn.bench plot``: prints each PNG written."""
    try:
        paths = plot_files(args.json_files, args.out)
    except ImportError as exc:
        raise SystemExit(str(exc)) from None
    for p in paths:
        print(p)
    return 0 if paths else 1


def plot_after_run(payload: dict, out_dir: str) -> List[str]:
    """``--plot DIR`` after a run: the charts of ``payload``; a failure is a line on stderr, never a crash."""
    try:
        paths = plot_result(payload, out_dir)
    except Exception as exc:  # noqa: BLE001 - the numbers are printed and saved already; a chart must not hide them
        print(f"plot: no charts ({type(exc).__name__}: {exc})", file=sys.stderr)
        return []
    for p in paths:
        print(f"chart: {p}")
    return paths
