"""The hand-written pages link the reference: each setting, command and metric a page names is
linked to its own anchor at least once on that page (``docs/reference_links.py``; the strict
site build fails on a link to an anchor that does not exist)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _links():
    spec = importlib.util.spec_from_file_location(
        "reference_links", ROOT / "docs" / "reference_links.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_links"] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


links = _links()
CATALOGUE = links.catalogue()


def test_every_page_links_the_settings_commands_and_metrics_it_names():
    missing = [
        f"docs/{page}: {t.page}#{t.anchor}"
        for page in links.pages()
        for t in links.unlinked(page, (links.DOCS / page).read_text(), CATALOGUE)
    ]
    assert not missing, "run python docs/reference_links.py:\n" + "\n".join(missing)


def test_the_first_prose_mention_is_linked_and_code_and_headings_are_left_alone():
    page = Path("how-to/x.md")
    text = (
        "## Using `task.family`\n\n"
        "```bash\nmarlow train task.family=general\n```\n\n"
        "Set `task.family=general`, then `task.family` again; run `marlow task check CONFIG`,\n"
        "watch `train/generator/grad_norm` and `chi2_update`; `device` and `examples/x.yaml` "
        "are no setting; `steps=12` is.\n"
    )
    linked = links.link(page, text, CATALOGUE)
    assert linked.startswith(
        "## Using `task.family`\n\n```bash\nmarlow train task.family=general\n```"
    )
    assert (
        "Set [`task.family=general`](../reference/settings.md#task.family), then `task.family`"
        in linked
    )
    assert "[`marlow task check CONFIG`](../reference/cli.md#marlow-task-check)" in linked
    assert "[`train/generator/grad_norm`](../reference/metrics.md#grad_norm)" in linked
    assert "[`chi2_update`](../reference/metrics.md#chi2_update)" in linked
    assert "`device` and `examples/x.yaml`" in linked
    assert "[`steps=12`](../reference/settings.md#steps)" in linked
    assert links.unlinked(page, linked, CATALOGUE) == {}
    assert links.link(page, linked, CATALOGUE) == linked  # linking twice changes nothing


def test_a_link_to_the_wrong_anchor_does_not_count():
    page = Path("tasks.md")
    wrong = "See [`task.family`](reference/settings.md#task.famly).\n"
    assert [t.anchor for t in links.unlinked(page, wrong, CATALOGUE)] == ["task.family"]
    assert links.link(page, wrong, CATALOGUE) == wrong  # named by the check, mended by hand
