"""Sphinx extension: the `gpu-results` directive shows a chapter's recorded `make gpu` runs on its page.

In a chapter's Markdown page:

    ```{gpu-results}
    ```

renders, under a "Measured on <GPU>" heading, the lab's glued scalars from every book/results/<gpu>/<chapter>.json
(`kvlab.book.report.gpu_results_table`), beside the CPU values of the lab's stored outputs, and one provenance line per
run (GPU, driver, CUDA, torch, transformers, kvlab commit, date). With no recorded run it says that no GPU run is
recorded yet. The chapter is the page's folder (`book/04_bandwidth_bound/index.md` -> `04_bandwidth_bound`), or
the directive's argument. `kvlab_gpu_results` (default `book/results`, relative to the book's root) is the folder.
Dry runs (`cpu-stub/`) are never shown.
"""

from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def table_node(columns, rows) -> nodes.table:
    """A docutils table (any builder renders it) with a header row."""
    table = nodes.table(classes=["kvlab-table", "kvlab-gpu-results"])
    group = nodes.tgroup(cols=len(columns))
    table += group
    for _ in columns:
        group += nodes.colspec(colwidth=1)
    for section, lines in ((nodes.thead(), [columns]), (nodes.tbody(), rows)):
        for cells in lines:
            row = nodes.row()
            for cell in cells:
                entry = nodes.entry()
                entry += nodes.paragraph(text=str(cell))
                row += entry
            section += row
        group += section
    return table


# What a page says before any GPU run is recorded, per edition: one line for readers. How to record a run is
# the maintainers' business (docs/running.md, "On a GPU").
NO_RUN_NOTES = {
    "en": [
        ("strong", "Measured on a GPU: "),
        ("text", "{no_run} for this chapter; the figures on this page come from a CPU."),
    ],
    "zh": [
        ("strong", "GPU 实测："),
        ("text", "本章还没有记录 GPU 运行；本页的数字来自 CPU。"),
    ],
}
_NODES = {"strong": nodes.strong, "literal": nodes.literal}


def no_run_note(language: str, chapter: str) -> nodes.paragraph:
    """The note of an edition's page for a chapter with no recorded GPU run."""
    from kvlab.book import report

    note = nodes.paragraph(classes=["kvlab-gpu-results"])
    for kind, text in NO_RUN_NOTES[language]:
        text = text.format(no_run=report.NO_GPU_RUN)
        note += _NODES[kind](text=text) if kind in _NODES else nodes.Text(text)
    return note


class GpuResults(SphinxDirective):
    optional_arguments = 1  # the chapter folder; default: the page's folder
    has_content = False

    def run(self) -> list[nodes.Node]:
        from kvlab.book import report
        from kvlab.book.sweep import glued_scalars

        page = Path(self.env.docname)
        # A Chinese page (book/zh/02_sizing.md) shows its chapter's runs, like book/02_sizing/index.md.
        default = page.name if page.parent.name == "zh" else page.parent.name
        chapter = self.arguments[0] if self.arguments else default
        results = Path(self.env.srcdir) / self.config.kvlab_gpu_results
        for path in sorted(results.glob(f"*/{chapter}.json")):
            self.env.note_dependency(str(path))  # a new or changed record rebuilds the page
        records = report.gpu_results(chapter, results)
        if not records:
            return [no_run_note("zh" if (self.config.language or "").startswith("zh") else "en", chapter)]
        lab = results.parent / chapter / "lab.ipynb"
        cpu = glued_scalars(lab) if lab.is_file() else None
        table = report.gpu_results_table(chapter, results, cpu=cpu)
        devices = list(dict.fromkeys(r["provenance"].get("device", r["gpu_folder"]) for r in records))
        heading = nodes.rubric(text="Measured on " + ", ".join(devices))
        intro = nodes.paragraph(
            text=(
                "The lab's glued values at the GPU sizes of kvlab/book/gpu_params.yaml (make gpu), beside the CPU"
                " values of its stored outputs. Each run's provenance:"
            )
        )
        provenance = nodes.bullet_list()
        for record in records:
            item = nodes.list_item()
            item += nodes.paragraph(text=report.gpu_provenance(record))
            provenance += item
        return [heading, intro, provenance, table_node(table.columns, table.formatted_rows())]


def setup(app):
    app.add_config_value("kvlab_gpu_results", "book/results", "env")
    app.add_directive("gpu-results", GpuResults)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
