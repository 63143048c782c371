// The calculator's memory snapshot (_ext/kvlab_calculator.py runs it at the end of an HTML build, under Node):
//   node snapshot.mjs PYODIDE_DIR KVLAB_ZIP OUT
// Pyodide boots CPython, unpacks kvlab.zip into site-packages, imports kvlab.calculator and answers one
// setting, then writes its WebAssembly memory, gzipped, to OUT. The page restores that memory instead of
// booting Python and importing kvlab itself, which took most of its first 10-20 s on a 2-core machine.
// The snapshot holds the interpreter's state only, not its files: the page still unpacks the same kvlab.zip,
// whose data (the registry's config.json files) kvlab reads when it sizes a model.
// `_makeSnapshot` and `_loadSnapshot` are Pyodide options its docs mark @ignore (Cloudflare's Python
// Workers use them); a snapshot loads only into the Pyodide build that made it (it checks a build id), and the
// browser test (tools/browser_calculator.py) compares every answer the page gives with `kvlab size --json`.
import { readFileSync, writeFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { gzipSync } from "node:zlib";

const [pyodideDir, zipPath, out] = process.argv.slice(2);
if (!out) {
  console.error("usage: node snapshot.mjs PYODIDE_DIR KVLAB_ZIP OUT");
  process.exit(2);
}
const { loadPyodide } = await import(pathToFileURL(`${pyodideDir}/pyodide.mjs`).href);
// A fixed hash seed: the same sources give the same interpreter state.
const pyodide = await loadPyodide({ indexURL: `${pyodideDir}/`, _makeSnapshot: true, env: { PYTHONHASHSEED: "0" } });
const site = pyodide.runPython("import sysconfig; sysconfig.get_paths()['purelib']");
pyodide.unpackArchive(new Uint8Array(readFileSync(zipPath)), "zip", { extractDir: site });
// One answer with a GPU imports what kvlab imports lazily (the budget path, the serve flags).
const answer = JSON.parse(
  pyodide.runPython(
    'import kvlab.calculator; kvlab.calculator.calculate_json(\'{"model": "meta-llama/Llama-3.1-8B", "gpu": "H100-SXM"}\')',
  ),
);
if (answer.error || !answer.budget) {
  console.error(`kvlab did not answer while the snapshot was made: ${JSON.stringify(answer).slice(0, 300)}`);
  process.exit(1);
}
const memory = pyodide.makeMemorySnapshot();
writeFileSync(out, gzipSync(memory, { level: 9 }));
console.log(`${out}: ${memory.length} bytes of memory, gzipped`);
