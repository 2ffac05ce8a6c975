"""The GitHub Actions workflow users can fork: valid YAML that runs the README's test command."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "test.yml"


def test_workflow_runs_make_test_on_push_and_pull_request():
    wf = yaml.safe_load(WORKFLOW.read_text())
    # YAML 1.1 reads the key `on` as True
    triggers = wf.get("on", wf.get(True))
    assert set(triggers) >= {"push", "pull_request"}
    job = wf["jobs"]["test"]
    assert "ubuntu-latest" in job["strategy"]["matrix"]["os"]
    assert job["runs-on"] == "${{ matrix.os }}" and job["timeout-minutes"] <= 90
    assert job["env"]["PIP_EXTRA_INDEX_URL"].endswith("/whl/cpu")  # the CPU torch build, not CUDA's
    runs = [step.get("run", "") for step in job["steps"]]
    assert "make test" in runs
    uses = [step.get("uses", "") for step in job["steps"]]
    assert any(u.startswith("actions/checkout@") for u in uses)
    assert any(u.startswith("actions/setup-python@") for u in uses)


def test_readme_and_ci_use_the_same_test_command():
    first_block = (ROOT / "README.md").read_text().split("```")[1]  # the README's opening commands
    assert "make lab" in first_block and "make test" in first_block
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci  # then the tests kept out of it (the JupyterHub class) after it
    assert "make test-class" in ci and ci.index("make test-class") > ci.index("make test")
    assert "make test-busy" in ci and ci.index("make test-busy") > ci.index("make test")
