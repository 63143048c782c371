// The book's calculator (book/calculator, _ext/kvlab_calculator.py): kvlab's own Python, run by Pyodide in the
// reader's browser from files of the built book. No formula lives here: every figure comes from
// kvlab.calculator, i.e. `kvlab size ... --json`. This script reads the form, keeps the settings in the
// URL, and draws what that JSON says. A classic script: opened from file://, where Chromium loads no module
// script, it says so instead of failing.
(() => {
const here = new URL(".", document.currentScript.src);
const root = document.querySelector(".kvlab-calculator");
const form = root.querySelector("form");
const status = root.querySelector(".kvlab-calc-status");
const result = root.querySelector(".kvlab-calc-result");
const zh = root.dataset.edition === "zh";
const T = zh
  ? { ready: "就绪：Python 已加载", took: "耗时", perToken: "每 token 的 KV", perSeq: "每序列的 KV",
      total: "KV 总量", weights: "权重", pool: "KV 池", fit: "可容纳的序列数", serve: "复现此设置的 vllm serve 命令",
      unmatched: "没有 vLLM 参数能复现", budget: "显存预算（逐项）", report: "kvlab size 的完整输出",
      error: "kvlab 拒绝了这个输入", nogpu: "选择一块 GPU 以查看显存预算", notfit: "各项之和超过显存容量" }
  : { ready: "Ready: Python loaded", took: "took", perToken: "KV per token", perSeq: "KV per sequence",
      total: "KV total", weights: "Weights", pool: "KV pool", fit: "Sequences that fit",
      serve: "The vllm serve command of this setting", unmatched: "No vLLM flag reproduces",
      budget: "The memory budget, term by term", report: "What kvlab size prints",
      error: "kvlab refuses this input", nogpu: "Pick a GPU to see the memory budget",
      notfit: "The terms exceed the GPU's memory" };

if (location.protocol === "file:") {
  status.textContent = zh
    ? "计算器需要通过网页服务器打开本书（例如在 _build/html 中运行 python3 -m http.server）。"
    : "The calculator needs the book served over HTTP (e.g. python3 -m http.server in _build/html).";
  return;
}

// Pyodide and kvlab load once, when this page opens.
const started = performance.now();
// Each phase's end, in ms since the script started, is kept on the page (data-phases) for the browser test.
const phases = {};
const mark = (name) => { phases[name] = Math.round(performance.now() - started); root.dataset.phases = JSON.stringify(phases); };
const fetched = (name) => fetch(new URL(name, here)).then((r) => {
  if (!r.ok) throw new Error(`${name}: HTTP ${r.status}`);
  return r.arrayBuffer();
});
// Pyodide's memory once Python had booted and imported kvlab (tools/calculator/snapshot.mjs): restoring it
// skips most of the first answer's wait. Gzipped on the site; a server that already decoded it is fine too.
// A browser without DecompressionStream boots Python itself, which is slower and gives the same answers.
const snapshot = typeof DecompressionStream === "undefined" ? undefined
  : fetched("kvlab.snapshot.gz").then((buf) => new Uint8Array(buf, 0, 2).join() !== "31,139" ? buf
    : new Response(new Blob([buf]).stream().pipeThrough(new DecompressionStream("gzip"))).arrayBuffer());
const ready = (async () => {
  const zip = fetched("kvlab.zip");
  const { loadPyodide } = await import(new URL("pyodide/pyodide.mjs", here).href);
  const pyodide = await loadPyodide({ indexURL: new URL("pyodide/", here).href, _loadSnapshot: snapshot });
  mark("python");
  // kvlab reads its data files (the registry's configs) when it sizes a model: the snapshot holds no files.
  const site = pyodide.runPython("import sysconfig; sysconfig.get_paths()['purelib']");
  pyodide.unpackArchive(new Uint8Array(await zip), "zip", { extractDir: site });
  const calculator = pyodide.pyimport("kvlab.calculator");
  mark("kvlab");
  return calculator;
})();

// The same object `kvlab size ... --json` prints for these long flags (named without their dashes).
window.kvlabCalc = async (args) => JSON.parse((await ready).calculate_json(JSON.stringify(args)));

function formArgs() {
  const args = {};
  for (const el of form.elements) {
    if (!el.name) continue;
    const value = el.value.trim();
    if (value !== "" && value !== el.dataset.default) args[el.name] = value;
  }
  if (args.config) delete args.model;
  else if (!args.model) args.model = form.elements.model.value;
  return args;
}

function fillForm(params) {
  for (const el of form.elements) {
    if (!el.name) continue;
    el.value = params.has(el.name) ? params.get(el.name) : el.dataset.default || "";
  }
}

const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const bytes = (n, text) => `${esc(text)} <span class="kvlab-calc-exact">(${Number(n).toLocaleString("en-US")} B)</span>`;

// The budget diagram: one stacked bar of the JSON's terms, heights in proportion to their bytes, labels beside.
function budgetSvg(terms, capacityText) {
  const shown = terms.filter((t) => t.bytes > 0);
  const width = Math.max(300, Math.min(result.clientWidth || 600, 640));
  const font = 13, gap = font + 5, barX = 8, barW = 64, top = 26;
  const barH = Math.max(260, gap * shown.length + 20);
  const total = shown.reduce((s, t) => s + t.bytes, 0);
  const parts = [`<text x="${barX}" y="${font + 2}" font-size="${font}" font-weight="bold">${esc(capacityText)}</text>`];
  let y = top;
  const centres = [];
  shown.forEach((t, i) => {
    const h = (t.bytes / total) * barH;
    const pool = t.name === "KV pool";
    parts.push(`<rect x="${barX}" y="${y.toFixed(2)}" width="${barW}" height="${h.toFixed(2)}" ` +
      `class="kvlab-calc-term${pool ? " kvlab-calc-pool" : ""}" data-term="${esc(t.name)}"/>`);
    centres.push(y + h / 2);
    y += h;
  });
  // labels at their term's height, pushed apart where terms are thin
  const placed = [];
  centres.forEach((c, i) => placed.push(i ? Math.max(c, placed[i - 1] + gap) : Math.max(c, top + font / 2)));
  const overflow = placed.length ? placed[placed.length - 1] - (top + barH) : 0;
  if (overflow > 0) for (let i = placed.length - 1; i >= 0; i--) placed[i] -= Math.min(overflow, placed[i] - top);
  const labelX = barX + barW + 30;
  shown.forEach((t, i) => {
    parts.push(`<path d="M${barX + barW} ${centres[i].toFixed(2)} H${barX + barW + 12} L${labelX - 4} ${placed[i].toFixed(2)}" class="kvlab-calc-leader"/>`);
    const weight = t.name === "KV pool" ? ' font-weight="bold"' : "";
    parts.push(`<text x="${labelX}" y="${(placed[i] + font / 3).toFixed(2)}" font-size="${font}"${weight} ` +
      `data-term="${esc(t.name)}">${esc(t.name)}: ${esc(t.text)}</text>`);
  });
  const height = Math.max(top + barH, placed.length ? placed[placed.length - 1] + gap : 0) + 6;
  return `<svg class="kvlab-calc-budget" role="img" aria-label="${esc(T.budget)}" width="${width}" ` +
    `height="${height.toFixed(0)}" viewBox="0 0 ${width} ${height.toFixed(0)}">${parts.join("")}</svg>`;
}

function render(out, ms) {
  if (out.error) {
    result.innerHTML = `<p class="kvlab-calc-error"><strong>${T.error}:</strong> ${esc(out.error)}</p>`;
    return;
  }
  const b = out.budget;
  const rows = [
    [T.perToken, bytes(out.kv_bytes_per_token, out.texts.kv_bytes_per_token)],
    [T.perSeq, bytes(out.kv_bytes_per_sequence, out.texts.kv_bytes_per_sequence)],
    [T.total, bytes(out.kv_bytes_total, out.texts.kv_bytes_total)],
    [T.weights, bytes(out.weight_bytes, out.texts.weight_bytes)],
  ];
  if (b) {
    rows.push([T.pool, bytes(b.kv_pool_bytes, out.texts.kv_pool_bytes)]);
    rows.push([T.fit, `<strong>${Number(out.sequences_fit).toLocaleString("en-US")}</strong>`]);
  }
  const table = rows.map(([k, v]) => `<tr><th scope="row">${k}</th><td>${v}</td></tr>`).join("");
  const terms = b ? (b.terms ? budgetSvg(b.terms, fmtCapacity(out)) : `<p>${T.notfit}</p>`) : `<p>${T.nogpu}</p>`;
  // SGLang's pool (kvlabCalc({engine: "sglang", ...})) has no vllm serve command.
  const serve = out.vllm_serve;
  const unmatched = serve && serve.unmatched.length
    ? `<p>${T.unmatched}:</p><ul>${serve.unmatched.map((u) => `<li>${esc(u)}</li>`).join("")}</ul>` : "";
  result.innerHTML =
    `<table class="kvlab-calc-figures"><tbody>${table}</tbody></table>` +
    `<h3>${T.budget}</h3>${terms}` +
    (serve ? `<h3>${T.serve}</h3><pre class="kvlab-calc-serve">${esc(serve.command)}</pre>${unmatched}` : "") +
    `<details><summary>${T.report}</summary><pre class="kvlab-calc-report">${esc(out.report)}</pre></details>`;
  status.textContent = `${T.ready} · ${T.took} ${ms.toFixed(0)} ms`;
}

const fmtCapacity = (out) => `${out.settings.gpu}: ${out.texts.capacity_bytes}`;

let pending = 0;
async function update() {
  const args = formArgs();
  const params = new URLSearchParams(args);
  history.replaceState(null, "", `${location.pathname}?${params}${location.hash}`);
  const ticket = ++pending;
  const t0 = performance.now();
  const out = await window.kvlabCalc(args);
  if (ticket !== pending) return;
  render(out, performance.now() - t0);
  root.dataset.answers = String(Number(root.dataset.answers || 0) + 1);
}

fillForm(new URLSearchParams(location.search));
let timer;
form.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(update, 150); });
form.addEventListener("submit", (e) => e.preventDefault());
ready.then(() => {
  root.dataset.loadMs = (performance.now() - started).toFixed(0);
  return update();
}).catch((err) => { status.textContent = `${T.error}: ${err}`; });
})();
