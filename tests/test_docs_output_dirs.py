"""Every example trains into an output_dir of its own: a reader who follows one page and then
another never finds the second page's run refused for, resumed from or complete with the first
one's (`runs/default` above all, where every run that does not say goes).

The examples: each `overdrive train` command in a code block of README.md and docs/*.md; each
YAML block that is a whole run (it has a `model` section, so it is trained as it is) and each
file a page writes (`cat > run.yaml <<'YAML'`); and the scripts in examples/, by the output
directory they use when not told one. A config of configs/ keeps its own directory for its runs. A command's directory is its
`output_dir=` item, else the last file it names that sets one, else that of the reader's own
file it names (`run.yaml` where the page does not write it), else `runs/default`. Two pages
may show the very same run (the embedded default, `overdrive train configs/zero3.yaml`), since
following both trains it once; two different runs never share a directory.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict

import yaml

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
HEREDOC = re.compile(r"^cat > (\S+) <<'?(\w+)'?\n(.*?)^\2$", re.S | re.M)
NAMED_BLOCK = re.compile(r"^`([\w.-]+\.ya?ml)`:\s*\n\s*\n```yaml\n(.*?)^```", re.S | re.M)
CONFIG_FILE = re.compile(r"\.(ya?ml|json)$")
# An example script's own output directory: an argparse default, or the constant it falls back on.
SCRIPT_DEFAULT = re.compile(r"""(?:"--output-dir", default=|OUTPUT_DIR = )"([^"]+)\"""")


def page_files(text: str) -> dict[str, dict]:
    """The run files a page writes: `cat > NAME <<` in a command block, a YAML block headed `NAME`:."""
    files = {name: body for name, _, body in HEREDOC.findall(text)}
    files.update(NAMED_BLOCK.findall(text))
    return {name: yaml.safe_load(body) or {} for name, body in files.items()}


def commands(text: str) -> list[list[str]]:
    """Each `overdrive train ...` of the page's code blocks that trains, as its arguments (comments
    dropped, a block's `NAME="..."` variables put in)."""
    found = []
    for _, block in BLOCK.findall(text):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^\$ |^! ", "", line.strip())
            assigned = re.fullmatch(r'(\w+)="(.*)"', line)
            if assigned:
                variables[assigned.group(1)] = assigned.group(2)
            line = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), line)
            match = re.search(r"(?:^|&& |\s)(?:\S*/)?overdrive train\b(.*)", line)
            if match is None or "..." in match.group(1) or "$" in match.group(1):
                continue  # `overdrive train ... key=value`: the command above, continued
            argv = shlex.split(match.group(1), comments=True)
            if "--print-launch" not in argv:  # prints the launch lines, trains nothing
                found.append(argv)
    return found


def output_dir(argv: list[str], files: dict[str, dict]) -> str:
    items = [a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")]
    if items:
        return items[-1]
    named = [a for a in argv if CONFIG_FILE.search(a)]
    for name in reversed(named):
        if name in files and "output_dir" in files[name]:
            return files[name]["output_dir"]
    readers = [name for name in named if name not in files]
    return f"{readers[0]}'s output_dir" if readers else "runs/default"


def examples() -> dict[str, dict[str, set[str]]]:
    """{output_dir: {page: the runs it trains there}}; a run of a file the page writes is named with the page."""
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for page in PAGES:
        text = page.read_text()
        written = page_files(text)
        for name, body in written.items():
            if "model" in body:  # a whole run, trained as it is
                found[body.get("output_dir", "runs/default")][page.name].add(f"overdrive train {name} ({page.name}'s)")
        for argv in commands(text):
            own = [a for a in argv if a in written]
            run = " ".join(["overdrive train", *argv]) + "".join(f" ({page.name}'s {name})" for name in own)
            found[output_dir(argv, {**CONFIGS, **written})][page.name].add(run)
    for script in sorted((REPO / "examples").glob("*.py")):
        for directory in SCRIPT_DEFAULT.findall(script.read_text()):
            found[directory][f"examples/{script.name}"].add(f"python examples/{script.name}")
    return found


CONFIGS = {f"configs/{p.name}": yaml.safe_load(p.read_text()) for p in sorted((REPO / "configs").glob("*.yaml"))}


def test_each_run_the_docs_and_examples_show_has_an_output_dir_of_its_own():
    found = examples()
    assert len(found) > 20 and "runs/default" in found  # the parsing finds the examples
    # Pages sharing a directory show the same runs there; a page shows as many as it likes in its own.
    shared = {directory: {page: sorted(runs) for page, runs in pages.items()} for directory, pages in found.items()
              if len({frozenset(runs) for runs in pages.values()}) > 1}
    assert not shared, "different runs, one output_dir:\n" + "\n".join(f"{d}: {p}" for d, p in shared.items())
    # A config's own directory holds runs of that config only (configs/zero3.yaml's runs/zero3).
    for name, body in CONFIGS.items():
        strays = [run for runs in found.get(body.get("output_dir", "runs/default"), {}).values() for run in runs
                  if name not in run.split()]
        assert not strays, f"{name}'s output_dir {body.get('output_dir')} also holds {strays}"


def test_a_command_names_its_output_dir_by_item_then_file_then_the_readers_own():
    files = {"configs/zero3.yaml": {"output_dir": "runs/zero3"}, "run.yaml": {"optim": {}}}
    assert output_dir(["configs/zero3.yaml", "output_dir=runs/x"], files) == "runs/x"
    assert output_dir(["configs/zero3.yaml", "lr=1"], files) == "runs/zero3"
    assert output_dir(["mine.yaml", "lr=1"], files) == "mine.yaml's output_dir"
    assert output_dir(["run.yaml"], files) == output_dir([], files) == "runs/default"
    assert commands("```bash\nbash x.sh && .venv/bin/overdrive train   # a comment\n! overdrive train a.yaml \\\n"
                    "  lr=1\noverdrive train ... lr=2\n```\n") == [[], ["a.yaml", "lr=1"]]
