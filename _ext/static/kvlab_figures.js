/* Wide figures and tables on a narrow screen (_ext/kvlab_figures.py; the CSS is kvlab_figures.css).

   A figure keeps 540 px on a phone so that its text stays at 9 CSS px or more; its box scrolls sideways. A table
   of the prose that is wider than the column gets narrower padding, or, if that is not enough, is stacked: one
   block per row, each cell under its column's heading. Whatever still scrolls (a figure, a table a lab prints)
   gets a line above it saying so, and its right edge fades while more of it lies to the right.
   tools/browser_book.py fails on a figure or table cut at the column with no such line. */
(() => {
  // Escaped, so that the file reads the same whatever encoding a page declares ("左右滑动查看其余部分 →").
  const HINT = {
    en: "Scroll sideways to see the rest \u2192",
    zh: "\u5de6\u53f3\u6ed1\u52a8\u67e5\u770b\u5176\u4f59\u90e8\u5206 \u2192",
  };
  const hintText = () => (document.documentElement.lang.startsWith("zh") ? HINT.zh : HINT.en);

  // The box the reader scrolls to see all of `el`: its nearest ancestor in the article that scrolls sideways.
  const scroller = (el) => {
    for (let up = el.parentElement; up && up.tagName !== "ARTICLE"; up = up.parentElement) {
      if (["auto", "scroll"].includes(getComputedStyle(up).overflowX)) return up;
    }
    return null;
  };

  // Each body cell carries its column's heading, which the stacked layout shows above the cell's text.
  const label = (table) => {
    if (table.dataset.kvlabLabelled) return;
    const heads = Array.from(table.querySelectorAll("thead th")).map((th) => th.innerText.trim());
    table.querySelectorAll("tbody tr").forEach((row) => {
      Array.from(row.children).forEach((cell, i) => {
        if (heads[i]) cell.dataset.kvlabLabel = heads[i];
      });
    });
    table.dataset.kvlabLabelled = "1";
  };

  const atEnd = (box) => box.scrollLeft + box.clientWidth >= box.scrollWidth - 1;

  const layout = () => {
    const article = document.querySelector("article");
    if (!article || !matchMedia("screen").matches) return;
    // A table of the prose (not a lab's printed output) that is wider than its column first loses some of its
    // cells' padding; if that is not enough, it is stacked.
    const wider = (table) => table.getBoundingClientRect().width > table.parentElement.clientWidth + 1;
    article.querySelectorAll("table").forEach((table) => {
      if (table.closest(".cell_output")) return;
      label(table);
      table.classList.remove("kvlab-compact", "kvlab-stacked");
      if (!wider(table)) return;
      table.classList.add("kvlab-compact");
      if (wider(table)) table.classList.replace("kvlab-compact", "kvlab-stacked");
    });
    // Every figure or table still wider than the box that scrolls it gets the hint above that box.
    const boxes = new Set();
    article.querySelectorAll("table, img").forEach((el) => {
      const box = scroller(el);
      if (box) boxes.add(box);
    });
    boxes.forEach((box) => {
      const wider = box.scrollWidth > box.clientWidth + 1;
      const before = box.previousElementSibling;
      let hint = before && before.classList.contains("kvlab-scroll-hint") ? before : null;
      if (wider && !hint) {
        hint = document.createElement("div");
        hint.className = "kvlab-scroll-hint";
        hint.setAttribute("role", "note");
        hint.textContent = hintText();
        box.before(hint);
        box.addEventListener("scroll", () => box.classList.toggle("kvlab-scroll-end", atEnd(box)), {
          passive: true,
        });
      }
      if (hint) hint.hidden = !wider;
      box.classList.toggle("kvlab-scrolls", wider);
      box.classList.toggle("kvlab-scroll-end", wider && atEnd(box));
    });
  };

  let queued = false;
  const queue = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      layout();
    });
  };

  // Whatever changes the article's size can change what is too wide: the window, loaded fonts and images, typeset
  // equations, a dropdown opened. Stacking a table changes only the article's height, so this settles.
  const start = () => {
    layout();
    const article = document.querySelector("article");
    if (article && window.ResizeObserver) new ResizeObserver(queue).observe(article);
    window.addEventListener("resize", queue);
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
