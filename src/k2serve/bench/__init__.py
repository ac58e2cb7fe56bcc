"""`k2serve bench`: a serving benchmark for any OpenAI-compatible server (k2serve, vLLM, SGLang).

Modules, one concern each:
- `datasets.py`: workloads (random lengths, ShareGPT, JSONL, shared prefix) -> `SampleRequest`s.
- `client.py`:   one streamed request over httpx with SSE parsing -> `RequestOutcome` (timings,
                 server-reported usage, error kind).
- `runner.py`:   arrivals (Poisson/gamma rate, burst, max concurrency), warm-ups, count/duration
                 bounds, progress bar.
- `metrics.py`:  TTFT / ITL / TPOT / E2EL statistics, throughput, goodput, errors by kind.
- `report.py`:   terminal table, JSON result file, `compare` table.
- `plot.py`:     PNG of latency distributions and throughput over time (matplotlib, Agg).
- `calibrate.py`: optional fit of the server's tokens per word (`--calibrate-input-len`).
- `cli.py`:      the `k2serve bench` flags (vLLM `bench serve` names) and subcommands;
  `compare_cli.py` is `k2serve bench compare`; the name `model` is reserved for a GPU model
  benchmark in its own module.

Invariant: token counts come from the server's `usage` (requested with
`stream_options.include_usage`); when a server sends none, counts fall back to the number of
content chunks and every report says so.
"""
