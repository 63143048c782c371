"""The planner against measured serving runs: published runs of real engines replayed through `simulate`.

Each stored run (benchmarks/data/measured/*.json, each file with its source, commit or URL and licence) names a
model, a GPU, the engine's settings, a workload and what was measured. `replay` rebuilds the workload as a
trace, runs `kvlab.planning.simulate.simulate` on the planner's step cost (`kvlab.planning.plan.RooflineStepCost`,
the realistic roofline model) at those settings, and returns one `Row` per run: predicted and measured TTFT,
ITL and end-to-end latency, in the statistic the source published (mean or median).

Two kinds of record:
- per request (BLIS's vLLM runs): every request's arrival, prompt and output length and its measured TTFT and
  end-to-end latency. The whole sweep is replayed on one timeline at its measured arrivals, and each
  benchmark's requests are scored; ITL is each request's (E2E - TTFT) / (output - 1), averaged, as GuideLLM's.
- summary (a concurrency or rate sweep): fixed or dataset-like lengths at a concurrency (closed loop) or a
  Poisson rate; the replay draws the workload (`kvlab.costs.workloads.Workload`).

`Constants` are the replay's free constants: the realistic model's three (`kvlab.costs.roofline.Realism`) and a
front-end delay per request (`kvlab.planning.frontend`). `CITED` is what `kvlab plan` ships, fitted to none of
these runs; `fit` tunes them on the calibration runs (`CALIBRATION`) only, and the rest are out of sample.
`benchmarks/planner_vs_measured.py` prints the table; `STORED` is its last output, which `kvlab plan` quotes
(`nearest`) and chapter 14's figure draws (`figure`). Chapter: *Capacity planning* (book/14_capacity_planning).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoConfig, PretrainedConfig

from kvlab.costs import budget, roofline
from kvlab.costs.workloads import TraceRequest, Workload
from kvlab.engine.metrics import RequestMetrics
from kvlab.planning.frontend import Frontend
from kvlab.planning.plan import RooflineStepCost
from kvlab.specs import arch

METRICS = ("ttft", "itl", "e2e")
NAMES = {"ttft": "TTFT", "itl": "ITL", "e2e": "E2E"}
STORED = Path(__file__).resolve().parents[1] / "data" / "planner_vs_measured.json"
# The fixed split: the synchronous benchmark of each BLIS sweep (one request at a time on an idle server, the
# closest a published run comes to a profile of the step) calibrates; every other run is out of sample.
CALIBRATION = "synchronous"


@dataclass(frozen=True)
class Constants:
    """The replay's free constants: the realistic step model's and the front end's delay per request."""

    realism: roofline.Realism = roofline.REALISM
    frontend: Frontend = Frontend()

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self.realism) | dataclasses.asdict(self.frontend)

    @classmethod
    def from_dict(cls, values: dict[str, float]) -> Constants:
        realism = {f.name: values[f.name] for f in dataclasses.fields(roofline.Realism)}
        frontend = {f.name: values[f.name] for f in dataclasses.fields(Frontend)}
        return cls(roofline.Realism(**realism), Frontend(**frontend))


# What `kvlab plan` runs: the cited ceilings and overhead of `kvlab.costs.roofline`, no front-end delay.
CITED = Constants()


@dataclass(frozen=True)
class Row:
    """One measured run against its replay: milliseconds per metric, in the source's `statistic`."""

    source: str
    run: str
    model: str
    params_b: float  # the model's parameters, billions (its size class)
    gpu: str
    tp: int
    engine: str
    statistic: str  # "mean" or "median"
    split: str  # "calibration" or "holdout"
    measured: dict[str, float]
    predicted: dict[str, float]

    def error(self, metric: str) -> float:
        """(predicted - measured) / measured."""
        return self.predicted[metric] / self.measured[metric] - 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MeasuredRunError(ValueError):
    """A stored run that cannot be replayed (the message names the file and the problem)."""


def load(folder: Path) -> list[dict[str, Any]]:
    """Every record in `folder` (*.json), sorted by file name, each with its file name under "file"."""
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        for key in ("source", "url", "licence", "runs"):
            if key not in record:
                raise MeasuredRunError(f"{path.name}: a measured run needs {key!r}")
        records.append(record | {"file": path.name})
    if not records:
        raise MeasuredRunError(f"no measured runs (*.json) in {folder}")
    return records


def model_config(record: dict[str, Any], run: dict[str, Any]) -> PretrainedConfig:
    """The run's model: the record's own config.json where it stores one, else kvlab's registry."""
    if "model_config" in record:
        stored = dict(record["model_config"])
        return AutoConfig.for_model(stored.pop("model_type"), **stored)
    return arch.get(str(run.get("model", record.get("model"))))


def _params_b(config: PretrainedConfig) -> float:
    return roofline.model_cost(config).params / 1e9


def _cost(config: PretrainedConfig, gpu: str, dtype: str, tp: int, constants: Constants) -> RooflineStepCost:
    return RooflineStepCost(config, gpu, dtype, dtype, tp, constants.realism)


def _stat(values: Sequence[float], statistic: str) -> float:
    return float(np.mean(values) if statistic == "mean" else np.median(values)) * 1e3


def _measures(requests: Sequence[RequestMetrics], statistic: str) -> dict[str, float]:
    """TTFT, per-request ITL ((E2E - TTFT) / (output - 1), GuideLLM's and vLLM's TPOT) and E2E, in ms."""
    tpot = [r.tpot for r in requests if r.tpot is not None]
    return {
        "ttft": _stat([r.ttft for r in requests], statistic),
        "itl": _stat(tpot, statistic),
        "e2e": _stat([r.e2e_latency for r in requests], statistic),
    }


def _replay_requests(record: dict[str, Any], constants: Constants) -> list[Row]:
    """A per-request record: the whole sweep on one timeline at its measured arrivals, scored per benchmark."""
    config = model_config(record, record)
    vocab = config.get_text_config(decoder=True).vocab_size
    prefix_len = int(record["workload"]["shared_prefix_tokens"])
    rng = np.random.default_rng(0)
    prefix = tuple(int(t) for t in rng.integers(10, vocab, prefix_len))
    trace = []
    for arrival, prompt, output, _, _ in record["requests"]:
        if prompt <= prefix_len:
            raise MeasuredRunError(
                f"{record['file']}: a prompt of {prompt} tokens is not past its shared prefix"
            )
        own = tuple(int(t) for t in rng.integers(10, vocab, prompt - prefix_len))
        trace.append(TraceRequest(float(arrival), prefix + own, max(int(output), 1), prefix_len > 0))
    result = constants.frontend.simulate(
        trace,
        _cost(config, record["gpu"], record["dtype"], int(record["tp"]), constants),
        num_blocks=int(record["num_gpu_blocks"]),
        block_size=int(record["block_size"]),
        max_num_seqs=int(record["max_num_seqs"]),
        max_num_batched_tokens=int(record["max_num_batched_tokens"]),
        max_model_len=int(record["max_model_len"]),
        enable_prefix_caching=bool(record["enable_prefix_caching"]),
    ).requests
    rows = []
    for run in record["runs"]:
        span = range(int(run["first"]), int(run["end"]))
        measured = [record["requests"][i] for i in span]
        itl = [(e2e - ttft) / (out - 1) for _, _, out, ttft, e2e in measured if out > 1]
        rows.append(
            _row(
                record,
                record,
                f"{Path(record['file']).stem.removeprefix('blis-')} {run['name']}",
                config,
                "mean",
                {
                    "ttft": _stat([m[3] for m in measured], "mean"),
                    "itl": _stat(itl, "mean"),
                    "e2e": _stat([m[4] for m in measured], "mean"),
                },
                _measures([result[i] for i in span], "mean"),
            )
        )
    return rows


def _row(
    record: dict[str, Any],
    run: dict[str, Any],
    name: str,
    config: PretrainedConfig,
    statistic: str,
    measured: dict[str, float],
    predicted: dict[str, float],
) -> Row:
    return Row(
        source=record["source"],
        run=name,
        model=run.get("model", record.get("model", "")),
        params_b=round(_params_b(config), 2),
        gpu=run.get("gpu", record.get("gpu", "")),
        tp=int(run.get("tp", record.get("tp", 1))),
        engine=f"{run.get('engine', record.get('engine'))} {run.get('version', record.get('version'))}",
        statistic=statistic,
        split="calibration" if name.endswith(f" {CALIBRATION}") else "holdout",
        measured={k: float(v) for k, v in measured.items()},
        predicted=predicted,
    )


def _replay_summary(record: dict[str, Any], constants: Constants) -> list[Row]:
    """A summary record: each run's workload drawn (fixed lengths at a concurrency, or dataset-like lengths at
    a Poisson rate) and replayed at vLLM's limits for the GPU."""
    rows = []
    for run in record["runs"]:
        config = model_config(record, run)
        gpu = run.get("gpu", record.get("gpu"))
        tp = int(run.get("tp", record.get("tp", 1)))
        dtype = run.get("dtype", record.get("dtype", "bf16"))
        max_model_len = int(run.get("max_model_len", record.get("max_model_len")))
        settings = budget.BudgetSettings(
            kv_dtype=dtype,
            weight_dtype=dtype,
            tp=tp,
            gpu_memory_utilization=float(record.get("gpu_memory_utilization", budget.GPU_MEMORY_UTILIZATION)),
            max_model_len=max_model_len,
        )
        pool = settings.memory_budget(config, gpu)
        batched, seqs = settings.batch_limits(gpu, config)
        vocab = config.get_text_config(decoder=True).vocab_size
        workload = record["workload"]
        if "concurrency" in run:
            count = max(50, 10 * int(run["concurrency"]))
            rng = np.random.default_rng(0)
            trace = [
                TraceRequest(
                    0.0,
                    tuple(int(t) for t in rng.integers(10, vocab, workload["input_tokens"])),
                    workload["output_tokens"],
                )
                for _ in range(count)
            ]
            concurrency: int | None = int(run["concurrency"])
        else:
            shape = Workload(
                mean_input=workload["mean_input_tokens"],
                mean_output=workload["mean_output_tokens"],
                max_input=workload["max_input_tokens"],
                max_output=workload["max_total_tokens"] - workload["max_input_tokens"],
                rate=float(run["rate"]),
                num_requests=int(run["num_prompts"]),
                seed=0,
            )
            trace = shape.trace(shape.rate, vocab, max_model_len)
            concurrency = None
        result = constants.frontend.simulate(
            trace,
            _cost(config, gpu, dtype, tp, constants),
            num_blocks=pool.num_blocks,
            block_size=pool.block_size,
            max_num_seqs=seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            concurrency=concurrency,
        ).requests
        statistic = record["statistic"]
        measured = {key.removesuffix("_ms"): value for key, value in run["measured"].items()}
        rows.append(_row(record, run, run["name"], config, statistic, measured, _measures(result, statistic)))
    return rows


def replay(record: dict[str, Any], constants: Constants = CITED) -> list[Row]:
    """Every run of one record, replayed on the planner's cost at `constants`."""
    if "requests" in record:
        return _replay_requests(record, constants)
    return _replay_summary(record, constants)


def replay_all(records: Iterable[dict[str, Any]], constants: Constants = CITED) -> list[Row]:
    return [row for record in records for row in replay(record, constants)]


def mape(rows: Sequence[Row], metric: str) -> float:
    """Mean absolute percentage error of `metric` over `rows`, in percent."""
    if not rows:
        raise ValueError("no runs to average")
    return 100 * float(np.mean([abs(r.error(metric)) for r in rows]))


def mape_line(label: str, rows: Sequence[Row]) -> str:
    """`label: N runs, TTFT MAPE X %, ITL MAPE Y %, E2E MAPE Z %`."""
    parts = ", ".join(f"{NAMES[m]} MAPE {mape(rows, m):.1f} %" for m in METRICS)
    return f"{label}: {len(rows)} runs, {parts}"


def groups(rows: Sequence[Row], key: Callable[[Row], str]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(key(row), []).append(row)
    return out


def summary_lines(rows: Sequence[Row]) -> list[str]:
    """Per source, per GPU, the calibration and held-out runs, then the `all:` line last."""
    lines = [mape_line(f"source {name}", part) for name, part in groups(rows, lambda r: r.source).items()]
    lines += [mape_line(f"gpu {name}", part) for name, part in sorted(groups(rows, lambda r: r.gpu).items())]
    for split in ("calibration", "holdout"):
        part = [r for r in rows if r.split == split]
        if part:
            lines.append(
                mape_line("in-sample (calibration)" if split == "calibration" else "out-of-sample", part)
            )
    lines.append(mape_line("all", rows))
    return lines


def worst(rows: Sequence[Row], count: int = 3) -> list[Row]:
    """The runs with the largest absolute error on any metric, worst first."""
    return sorted(rows, key=lambda r: -max(abs(r.error(m)) for m in METRICS))[:count]


# --- fitting the constants on the calibration runs ---------------------------------------------------------------


FITTED_NAMES = ("bandwidth_efficiency", "flops_efficiency", "step_overhead_s", "request_overhead_s")


def _loss(rows: Sequence[Row]) -> float:
    """Mean squared log error over the calibration runs' metrics: over- and under-prediction alike."""
    return float(np.mean([math.log(r.predicted[m] / r.measured[m]) ** 2 for r in rows for m in METRICS]))


def fit(records: Sequence[dict[str, Any]], start: Constants = CITED, iterations: int = 60) -> Constants:
    """The constants that best replay the calibration runs (`CALIBRATION`), by Nelder-Mead on the log error.

    Only the per-request records' calibration benchmarks are replayed (each alone, on its own timeline), so
    the held-out runs never enter the fit. Efficiencies stay in (0, 1], delays >= 0."""
    calibration = [
        record | {"runs": [run for run in record["runs"] if run["name"] == CALIBRATION]}
        for record in records
        if "requests" in record
    ]
    calibration = [_only_runs(record) for record in calibration if record["runs"]]
    if not calibration:
        raise MeasuredRunError("no calibration runs to fit the constants on")

    def constants_at(x: np.ndarray) -> Constants:
        values = dict(zip(FITTED_NAMES, x, strict=True))
        return Constants(
            roofline.Realism(
                bandwidth_efficiency=float(np.clip(values["bandwidth_efficiency"], 0.05, 1.0)),
                flops_efficiency=float(np.clip(values["flops_efficiency"], 0.05, 1.0)),
                step_overhead_s=float(max(values["step_overhead_s"], 0.0)),
            ),
            Frontend(request_overhead_s=float(max(values["request_overhead_s"], 0.0))),
        )

    def loss(x: np.ndarray) -> float:
        return _loss(replay_all(calibration, constants_at(x)))

    x0 = np.array(
        [
            start.realism.bandwidth_efficiency,
            start.realism.flops_efficiency,
            start.realism.step_overhead_s,
            start.frontend.request_overhead_s,
        ]
    )
    steps = np.array([0.1, 0.1, 1e-3, 10e-3])
    return constants_at(nelder_mead(loss, x0, steps, iterations))


def _only_runs(record: dict[str, Any]) -> dict[str, Any]:
    """A per-request record cut to the requests of its runs, renumbered: the rest never reach the engine."""
    keep = [i for run in record["runs"] for i in range(int(run["first"]), int(run["end"]))]
    first = min(keep)
    requests = [list(record["requests"][i]) for i in keep]
    for request in requests:
        request[0] -= record["requests"][first][0]
    runs = []
    offset = 0
    for run in record["runs"]:
        size = int(run["end"]) - int(run["first"])
        runs.append(run | {"first": offset, "end": offset + size})
        offset += size
    return record | {"requests": requests, "runs": runs}


def nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, steps: np.ndarray, iterations: int
) -> np.ndarray:
    """Minimise `f` from `x0` by the Nelder-Mead simplex (Nelder & Mead, 1965, Computer Journal 7(4)), with
    the standard coefficients (reflection 1, expansion 2, contraction 0.5, shrink 0.5)."""
    simplex = [x0.astype(float)] + [x0 + np.eye(len(x0))[i] * steps[i] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


# --- the stored table --------------------------------------------------------------------------------------------


@dataclass
class Table:
    """The stored error table: the constants of each model and its rows."""

    models: dict[str, Constants]
    rows: dict[str, list[Row]] = field(default_factory=dict)

    def dumps(self) -> str:
        body = {
            "about": (
                "benchmarks/planner_vs_measured.py's last run: every stored measured run (benchmarks/data/measured) "
                "against kvlab.planning.simulate on the planner's cost, per constants (cited: kvlab plan's; fitted: "
                f"tuned on the '{CALIBRATION}' runs only). Times in ms."
            ),
            "models": {
                name: {"constants": c.as_dict(), "rows": [r.as_dict() for r in self.rows.get(name, [])]}
                for name, c in self.models.items()
            },
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def loads(cls, text: str) -> Table:
        body = json.loads(text)
        models = {name: Constants.from_dict(m["constants"]) for name, m in body["models"].items()}
        rows = {name: [Row(**r) for r in m["rows"]] for name, m in body["models"].items()}
        return cls(models, rows)


def stored(path: Path = STORED) -> Table:
    return Table.loads(path.read_text())


# --- chapter 14's figure -----------------------------------------------------------------------------------------


def nearest(rows: Sequence[Row], gpu: str, params_b: float) -> tuple[str, list[Row]]:
    """The stored runs most like a plan: on `gpu` where the table has it, else every GPU; of those, the runs
    whose model is nearest in size (within 2x of the closest one's parameters). Returns (what was matched,
    the rows)."""
    if not rows:
        raise ValueError("no stored runs")
    same = [r for r in rows if r.gpu.lower() == gpu.lower()]
    pool, where = (same, gpu) if same else (list(rows), "any GPU")
    closest = min(pool, key=lambda r: abs(math.log(r.params_b / params_b))).params_b
    chosen = [r for r in pool if abs(math.log(r.params_b / closest)) <= math.log(2)]
    sizes = sorted({r.params_b for r in chosen})
    span = f"{sizes[0]:.1f}B" if len(sizes) == 1 else f"{sizes[0]:.1f}-{sizes[-1]:.1f}B"
    return f"{where}, {span} models", chosen


def track_record(gpu: str, model: roofline.Config, table: Table | None = None) -> str:
    """`kvlab plan`'s line on how far off the planner has been on stored measured runs like the one asked
    for (`nearest`: the GPU, and models of a similar size)."""
    table = stored() if table is None else table
    params_b = roofline.model_cost(model).params / 1e9
    matched, cited = nearest(table.rows["cited"], gpu, params_b)
    names = {(r.source, r.run) for r in cited}
    fitted = [r for r in table.rows["fitted"] if (r.source, r.run) in names]

    def errors(rows: Sequence[Row]) -> str:
        return ", ".join(f"{NAMES[m]} {mape(rows, m):.0f} %" for m in METRICS)

    delay_ms = table.models["fitted"].frontend.request_overhead_s * 1e3
    return (
        f"measured     {len(cited)} published runs like this ({matched}; benchmarks/planner_vs_measured.py) "
        f"came out with MAPE {errors(cited)}; refitted on the {CALIBRATION} runs (the step's three constants and "
        f"a front-end delay of {delay_ms:.0f} ms per request, which --frontend-delay adds), {errors(fitted)}"
    )
