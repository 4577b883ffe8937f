"""The documentation pages the code names exist, and ship with the package (docs/ installs as qtrain/docs)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_docs_page_a_module_names_exists_and_is_packaged():
    named = {page for path in (ROOT / "qtrain").rglob("*.py")
             for page in re.findall(r"docs/[\w/.-]+?\.md", path.read_text())}
    assert named, "no module names a docs page"
    missing = sorted(page for page in named if not (ROOT / page).is_file())
    assert not missing, missing
    pyproject = (ROOT / "pyproject.toml").read_text()  # Python 3.10 has no tomllib
    assert '"qtrain.docs" = "docs"' in pyproject and '"qtrain.docs" = ["**/*.md"]' in pyproject


def test_the_readmes_default_job_table_is_the_committed_output_of_its_command():
    """The README quotes results/default_job.txt (``make default-job-figures``), not a figure typed by hand."""
    committed = (ROOT / "results" / "default_job.txt").read_text().splitlines()
    assert committed[0].startswith("# make default-job-figures: qtrain -m method=sbm,float32 on ")
    readme = (ROOT / "README.md").read_text()
    quoted = readme.split("it ended:\n\n```\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert quoted == committed[1:] and len(quoted) == 3  # the header, float32's row and SBM's
