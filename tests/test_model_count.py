"""Every page that states how many models the registry holds states the registry's own count."""

import re
from pathlib import Path

from kvlab.specs import arch

ROOT = Path(__file__).resolve().parents[1]
# "29 models", "34 published `config.json` files", "34 published configs": a count of the registry's models.
COUNT = re.compile(r"\b(\d+) (?:models\b|published `config\.json` files|published configs|个模型)")


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return found + sorted(p for p in (ROOT / "book").rglob("*.md") if "_build" not in p.parts)


def test_every_stated_model_count_is_the_registry_s():
    n = len(arch.registry())
    wrong = [
        f"{page.relative_to(ROOT)}: {m.group(0)!r}"
        for page in pages()
        for m in COUNT.finditer(page.read_text())
        if int(m.group(1)) != n and _about_the_registry(page.read_text(), m.start())
    ]
    assert not wrong, f"the registry holds {n} models: {wrong}"


def _about_the_registry(text: str, at: int) -> bool:
    """A count near "registry", "checked to the byte" or "per-token bytes": the registry's, not a figure's."""
    window = text[max(0, at - 200) : at + 80].lower()
    return any(w in window for w in ("registry", "to the byte", "per-token bytes", "注册表"))


def test_the_count_is_found_where_the_readme_states_it():
    readme = (ROOT / "README.md").read_text()
    assert any(_about_the_registry(readme, m.start()) for m in COUNT.finditer(readme))
