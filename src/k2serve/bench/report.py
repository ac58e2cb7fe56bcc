"""Terminal table, JSON result file and the side-by-side `compare` table.

The JSON result file holds the summary (vLLM key names: `request_throughput`, `mean_ttft_ms`,
...), the run's settings, and one record per request (enough to redraw the plot). `compare`
reads two such files; it also reads vLLM `--save-result` files for the keys they share.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from k2serve.bench.client import RequestOutcome
from k2serve.bench.metrics import pct_key

FORMAT = "k2serve-bench/1"
WIDTH = 50
NAMES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<40} {value:<10}"


def _rule(title: str = "", ch: str = "-") -> str:
    return f"{title:{ch}^{WIDTH}}"


def format_table(res: dict[str, Any]) -> str:
    cfg = res.get("config", {})
    lines = [_rule(" Serving Benchmark Result ", "=")]
    if cfg:
        lines.append(_row("Endpoint:", cfg.get("url", "?")))
        lines.append(_row("Model:", cfg.get("model", "?")))
        rate = cfg.get("request_rate")
        lines.append(_row("Request rate (req/s):", "inf" if rate in (None, "inf") else rate))
        lines.append(_row("Max concurrency:", cfg.get("max_concurrency") or "none"))
    lines += [
        _row("Successful requests:", res["completed"]),
        _row("Failed requests:", res["failed"]),
        _row("Benchmark duration (s):", res["duration"]),
        _row("Total input tokens:", res["total_input_tokens"]),
        _row("Total generated tokens:", res["total_output_tokens"]),
        _row("Request throughput (req/s):", res["request_throughput"]),
    ]
    if "request_goodput" in res:
        lines.append(_row("Request goodput (req/s):", res["request_goodput"]))
    lines += [
        _row("Input token throughput (tok/s):", res["input_throughput"]),
        _row("Output token throughput (tok/s):", res["output_throughput"]),
        _row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"]),
        _row("Total Token throughput (tok/s):", res["total_token_throughput"]),
    ]
    if res["token_counts"] != "usage":
        lines.append(
            f"NOTE: token counts: {res['token_counts']}: only {res['requests_with_usage']} of "
            f"{res['completed']} responses carried usage; for the others output = content "
            "chunks, input = intended prompt words."
        )
    for key, (title, short) in NAMES.items():
        lines.append(_rule(title))
        lines.append(_row(f"Mean {short} (ms):", res[f"mean_{key}_ms"]))
        lines.append(_row(f"Median {short} (ms):", res[f"median_{key}_ms"]))
        for p in res["percentiles"]:
            if p == 50:
                continue  # = the median, already shown
            lines.append(_row(f"P{p:g} {short} (ms):", res[f"{pct_key(p)}_{key}_ms"]))
    if res.get("goodput_slos_ms"):
        lines.append(_rule("Goodput SLOs"))
        for k, v in res["goodput_slos_ms"].items():
            lines.append(_row(f"{k.upper()} <= (ms):", v))
        lines.append(_row("Requests meeting all SLOs:", res["good_requests"]))
    if res["errors_by_kind"]:
        lines.append(_rule("Errors"))
        examples = res.get("error_examples") or {}
        for kind, n in res["errors_by_kind"].items():
            lines.append(_row(f"{kind}:", n))
            if examples.get(kind):
                lines.append(f"  server said: {_server_message(examples[kind])}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _server_message(detail: str) -> str:
    """The `message` of an OpenAI error body, else the text, on one line."""
    try:
        body = json.loads(detail)
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message") if isinstance(err, dict) else None
        if msg:
            return str(msg)[:300]
    except (ValueError, AttributeError):
        pass
    return " ".join(detail.split())[:300]


def _clean(v: Any) -> Any:
    """NaN -> None so the file is strict JSON."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def _request_record(o: RequestOutcome) -> dict[str, Any]:
    d = asdict(o)
    for k in ("start", "ttft", "latency"):
        if d[k] is not None:
            d[k] = round(d[k], 6)
    d["itls"] = [round(x, 6) for x in o.itls]
    d["chunk_times"] = [round(x, 6) for x in o.chunk_times]
    return d


def write_result(path: Path, res: dict[str, Any], outcomes: list[RequestOutcome]) -> dict[str, Any]:
    doc = {"format": FORMAT, **res, "requests": [_request_record(o) for o in outcomes]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), indent=1))
    return doc


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such result file")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not a JSON result file: {e}") from None
    if not isinstance(doc, dict) or not ("completed" in doc or "request_throughput" in doc):
        raise ValueError(f"{p}: not a benchmark result (no 'completed'/'request_throughput')")
    return doc


def outcomes_from_result(doc: dict[str, Any]) -> list[RequestOutcome]:
    fields = RequestOutcome.__dataclass_fields__
    return [
        RequestOutcome(**{k: v for k, v in r.items() if k in fields})
        for r in doc.get("requests", [])
    ]


# (key, label, higher_is_better)
COMPARE_ROWS: list[tuple[str, str, bool]] = [
    ("completed", "Successful requests", True),
    ("failed", "Failed requests", False),
    ("duration", "Duration (s)", False),
    ("total_input_tokens", "Input tokens", True),
    ("total_output_tokens", "Output tokens", True),
    ("request_throughput", "Request throughput (req/s)", True),
    ("request_goodput", "Request goodput (req/s)", True),
    ("output_throughput", "Output throughput (tok/s)", True),
    ("total_token_throughput", "Total throughput (tok/s)", True),
]


def _compare_rows(a: dict, b: dict) -> list[tuple[str, str, bool]]:
    rows = list(COMPARE_ROWS)
    pcts = [float(p) for p in a.get("percentiles", [99])]
    for key, (_, short) in NAMES.items():
        rows.append((f"mean_{key}_ms", f"Mean {short} (ms)", False))
        rows.append((f"median_{key}_ms", f"Median {short} (ms)", False))
        for p in pcts:
            rows.append((f"{pct_key(p)}_{key}_ms", f"P{p:g} {short} (ms)", False))
    return [r for r in rows if a.get(r[0]) is not None or b.get(r[0]) is not None]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return str(v)


def compare_table(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Side by side, with B/A ratios; '+' marks where B is better, '-' where it is worse."""
    rows = _compare_rows(a, b)
    w = max(12, len(name_a), len(name_b))
    head = f"{'Metric':<32} {name_a:>{w}} {name_b:>{w}} {'B/A':>8}"
    lines = [head, "-" * len(head)]
    for key, label, higher_better in rows:
        va, vb = a.get(key), b.get(key)
        ratio = "-"
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va != 0:
            r = vb / va
            if not math.isnan(r):
                better = (r > 1) == higher_better
                mark = " " if r == 1 else ("+" if better else "-")
                ratio = f"{r:.3f}{mark}"
        lines.append(f"{label:<32} {_fmt(va):>{w}} {_fmt(vb):>{w}} {ratio:>8}")
    for tag, doc in (("A", a), ("B", b)):
        ca = doc.get("config", {})
        src = doc.get("token_counts", "usage")
        where = ca.get("url", doc.get("backend", "?"))
        model = ca.get("model", doc.get("model_id", "?"))
        lines.append(f"{tag}: {where} model={model} token counts={src}")
    lines.append("'+' = B better, '-' = B worse (latency: lower is better)")
    return "\n".join(lines)
