"""Pages rendered from saved results must render again, and say what is committed:
a renderer that no longer reads its own saved JSON, or a page edited by hand, fails here."""

import json

from benchmarks import oscar_kernels
from evalkit.data import REPO


def test_kernels_page_is_its_render():
    saved = json.loads((REPO / "benchmarks" / "results" / "oscar_kernels.json").read_text())
    page = (REPO / "docs" / "kernels.md").read_text()
    own = page[: page.index(oscar_kernels.STEPQUANT_SECTION)] if oscar_kernels.STEPQUANT_SECTION in page else page
    assert oscar_kernels.render(saved).rstrip() == own.rstrip()
