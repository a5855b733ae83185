"""The docs hold: README.md and docs/*.md code blocks run, their commands, paths and links exist.

Every ```python block runs in a fresh namespace, unless the line before it is a comment
`<!-- not run: WHY; tests/... -->` naming an existing test or script that exercises the same
code (blocks that need a trained workdir). ```bash blocks are not run (they train for
minutes to hours); the scripts, configs and flags they name must exist. Every relative link
and anchor resolves; the README's install and test commands are the ones CI runs; the results
index names every results file.
"""

import contextlib
import importlib
import io
import os
import re
import shlex

import pytest

from mdjax import sampling_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(DOCS)
                               if name.endswith(".md"))
INDEXED = PAGES + [os.path.join("results", "README.md")]  # link-checked as well

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(.*?)-->\s*$")
# A path in the repository; not a pattern such as configs/shakespeare_*.py or test_<module>.py.
REPO_PATH = re.compile(r"\b((?:tests|experiments|configs|mdjax|results|docs)/[\w./-]*\w)(?![\w*<{])")


def _read(page):
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


def _blocks(lang):
  """(page, line, code, not-run note or None, shown output or None) for each block of `lang`.

  The shown output is a plain ``` block right after the code block (a blank line between).
  """
  out = []
  for page in PAGES:
    text = _read(page)
    matches = list(FENCE.finditer(text))
    for i, match in enumerate(matches):
      if match.group(1) != lang:
        continue
      line = text.count("\n", 0, match.start()) + 1
      before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
      note = NOT_RUN.match(before)
      shown = None
      if i + 1 < len(matches) and not matches[i + 1].group(1) and \
          not text[match.end():matches[i + 1].start()].strip():
        shown = matches[i + 1].group(2)
      out.append((page, line, match.group(2), note.group(1).strip() if note else None, shown))
  return out


PYTHON = _blocks("python")
BASH = _blocks("bash")


def _id(block):
  return f"{block[0]}:{block[1]}"


@pytest.mark.xdist_group("docs")
@pytest.mark.parametrize("block", [b for b in PYTHON if b[3] is None], ids=_id)
@pytest.mark.slow
def test_python_block_runs(block):
  """The block runs; where the page shows its output, it prints exactly that."""
  page, line, code, _, shown = block
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__docs__"})  # pylint: disable=exec-used
  if shown is not None:
    assert printed.getvalue() == shown, f"{page}:{line} printed:\n{printed.getvalue()}"


@pytest.mark.parametrize("block", [b for b in PYTHON if b[3] is not None], ids=_id)
def test_not_run_block_names_an_existing_test(block):
  page, line, _, note, _ = block
  named = REPO_PATH.findall(note)
  runners = [path for path in named
             if path.startswith(("tests/", "experiments/")) and path.endswith(".py")]
  assert runners, f"{page}:{line}: a not-run block must name the test or script that runs its code"
  for path in named:
    assert os.path.isfile(os.path.join(ROOT, path)), f"{page}:{line}: {path} does not exist"


def test_blocks_are_found():
  """The extraction sees the blocks, and no fence is indented (which it would miss)."""
  assert len([b for b in PYTHON if b[3] is None]) >= 5 and len(BASH) >= 10
  indented = [f"{page}:{i + 1}" for page in PAGES
              for i, line in enumerate(_read(page).split("\n")) if re.match(r"\s+```", line)]
  assert not indented, f"indented code fences (start them at column 0): {indented}"


# ----------------------------------------------------------------------------
# Commands in bash blocks.
# ----------------------------------------------------------------------------


def _commands(code):
  """Each command of a bash block as a token list (continuations joined, comments dropped)."""
  lines, pending = [], ""
  for raw in code.replace("\\\n", " ").split("\n"):
    pending = f"{pending}\n{raw}" if pending else raw
    try:
      tokens = shlex.split(pending, comments=True)
    except ValueError:  # an open quote: the argument goes on past the line
      continue
    pending = ""
    command = []
    for token in tokens + ["&&"]:
      if token in ("&&", ";", "||", "|"):
        if command:
          lines.append(command)
        command = []
      else:
        command.append(token)
  assert not pending, f"unclosed quote in {code!r}"
  return lines


def _flag_sources(program):
  """Source text that defines the flags of `program` (a script path or a module name)."""
  files = [os.path.join(dirpath, name) for dirpath, _, names in os.walk(os.path.join(ROOT, "mdjax"))
           for name in names if name.endswith(".py")]
  if program.endswith(".py"):
    files.append(os.path.join(ROOT, program))
  if program.startswith("experiments/"):  # --smoke and the shared command line
    files.append(os.path.join(ROOT, "experiments", "smoke.py"))
  texts = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      texts.append(f.read())
  return "\n".join(texts)


def _defines(source, name):
  if name in sampling_cli.sampler_flags():  # generated from the knob registry
    return True
  quoted = re.escape(name)
  patterns = (rf"DEFINE_\w+\(\s*[\"']{quoted}[\"']", rf"add_argument\(\s*[\"']--{quoted}[\"']",
              rf"[\"']{quoted}[\"']\s*:\s*\(")  # report.experiment_main's options
  return any(re.search(p, source) for p in patterns)


def _config_has(config_file, path):
  module = importlib.import_module(config_file[:-len(".py")].replace("/", "."))
  node = module.get_config()
  for field in path.split("."):
    if field not in node:
      return False
    node = node[field]
  return True


def _check_command(tokens):
  """What a command names exists: its script or module, its paths, flags and config fields."""
  problems = []
  for token in tokens:
    for path in REPO_PATH.findall(token):
      if not os.path.exists(os.path.join(ROOT, path)):
        problems.append(f"{path} does not exist")
  program = os.path.basename(tokens[0])
  if program == "bash":
    if not os.path.isfile(os.path.join(ROOT, tokens[1])):
      problems.append(f"{tokens[1]} does not exist")
    return problems
  if not program.startswith("python"):
    return problems  # pip, printf: nothing of the repository's to check
  if tokens[1] == "-m":
    target, args = tokens[2], tokens[3:]
    if target in ("pytest", "venv", "pip"):
      return problems
    base = os.path.join(ROOT, *target.split("."))
    if not (os.path.isfile(base + ".py") or os.path.isdir(base)):
      return problems + [f"module {target} does not exist"]
  else:
    target, args = tokens[1], tokens[2:]
    if not os.path.isfile(os.path.join(ROOT, target)):
      return problems + [f"{target} does not exist"]
  source = _flag_sources(target)
  config = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
  for arg in args:
    if not arg.startswith("--"):
      continue
    name = arg[2:].split("=", 1)[0]
    if name.startswith("config."):
      if config is None or not _config_has(config, name[len("config."):]):
        problems.append(f"{arg}: {config} has no field {name[len('config.'):]}")
    elif name != "help" and not (_defines(source, name) or
                                 (name.startswith("no") and _defines(source, name[2:]))):
      problems.append(f"{arg}: {target} defines no flag --{name}")
  return sorted(set(problems))


@pytest.mark.parametrize("block", BASH, ids=_id)
def test_bash_block_names_what_exists(block):
  page, line, code, _, _ = block
  problems = [p for tokens in _commands(code) for p in _check_command(tokens)]
  assert not problems, f"{page}:{line}: " + "; ".join(problems)


def test_readme_commands_are_what_ci_runs():
  """The README's first three commands: the two set-up commands and the test command of .ci/run."""
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci_line = [line for line in f if "pytest" in line][-1]
  ci = [" ".join(shlex.split(part)) for part in ci_line.split("&&")]
  readme = [b for b in BASH if b[0] == "README.md"][:3]
  readme = [" ".join(tokens) for b in readme for tokens in _commands(b[2])]
  assert readme == ci, (readme, ci)


def test_paths_named_in_prose_exist():
  """Every tests/, experiments/, configs/ file a page names (outside code blocks) is there."""
  missing = []
  for page in INDEXED:
    text = FENCE.sub("", _read(page))
    for path in REPO_PATH.findall(text):
      if path.startswith(("tests/", "experiments/", "configs/")) and \
          not os.path.exists(os.path.join(ROOT, path)):
        missing.append(f"{page}: {path}")
  assert not missing, missing


# ----------------------------------------------------------------------------
# Links, anchors and the results index.
# ----------------------------------------------------------------------------


def _slug(heading):
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(page):
  seen, anchors = {}, set()
  for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", _read(page)), flags=re.M):
    slug = _slug(heading)
    anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


def test_relative_links_and_anchors_resolve():
  broken = []
  for page in INDEXED:
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", _read(page)))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target):
        continue  # http(s), mailto
      path, _, anchor = target.partition("#")
      resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
      if not os.path.exists(os.path.join(ROOT, resolved)):
        broken.append(f"{page}: {target} (no file {resolved})")
      elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
        broken.append(f"{page}: {target} (no heading #{anchor} in {resolved})")
  assert not broken, broken


def test_results_index_lists_every_results_file():
  index = _read(os.path.join("results", "README.md"))
  listed = set(re.findall(r"^\| `([^`]+)` \|", index, flags=re.M))
  present = {name for name in os.listdir(os.path.join(ROOT, "results")) if name != "README.md"}
  assert present == listed, (sorted(present - listed), sorted(listed - present))


def test_each_listing_of_the_sampler_families_is_the_registry():
  """A page that lists `families()` lists every registered family (generation.md once listed
  11 of the 15)."""
  from mdjax import sampling
  listing = re.compile(r"families\(\)`[^(:\n]*[:(]\s*(\w+(?:,\s*\w+)+)\)")
  found = [(page, sorted(re.split(r",\s*", m.group(1))))
           for page in PAGES for m in listing.finditer(_read(page))]
  assert len(found) >= 2, found  # generation.md and samplers.md
  for page, names in found:
    assert names == sorted(sampling.families()), page
