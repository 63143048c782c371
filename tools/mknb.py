"""Convert a py-percent script to .ipynb (no outputs). Usage: mknb.py src.py out.ipynb"""
import json, re, sys
import nbformat
src = open(sys.argv[1]).read()
cells = []
for chunk in re.split(r"^# %%", src, flags=re.M)[1:]:
    header, _, body = chunk.partition("\n")
    body = body.strip("\n")
    tags = re.findall(r'"([^"]+)"', header.split("tags=")[1]) if "tags=" in header else []
    if "[markdown]" in header:
        text = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in body.splitlines())
        cells.append(nbformat.v4.new_markdown_cell(text))
    else:
        c = nbformat.v4.new_code_cell(body)
        if tags: c.metadata["tags"] = tags
        cells.append(c)
nb = nbformat.v4.new_notebook(cells=cells)
nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
nb.metadata["language_info"] = {"name": "python"}
for i, c in enumerate(nb.cells):
    c["id"] = f"cell-{i:02d}"
nbformat.write(nb, sys.argv[2])
