"""The terminal live view (mdjax.serve.terminal.live, sample.py --live): a frame a step, the
masked positions counted down to none, and the completion mdjax.generate gives."""

import io
import re
import unicodedata

import jax
import pytest

import mdjax
from mdjax.generation import prompt_ids
from mdjax.serve import terminal

FRAME = re.compile(r"^step (\d+)/(\d+)  masked (\d+)/(\d+)$", re.M)


@pytest.fixture(scope="module")
def char_model(trained):
  root, _ = trained
  return mdjax.load(str(root / "char"))


def frames_of(text: str) -> list[tuple[int, int, int, str]]:
  """(step, num_steps, masked, canvas) of each printed frame."""
  blocks = [b for b in text.split("\n\n") if b.strip()]
  frames = []
  for block in blocks:
    head, *body = block.split("\n")
    match = FRAME.match(head)
    assert match, block
    step, num_steps, masked, length = map(int, match.groups())
    canvas = "".join(body)
    assert len(canvas) == length and canvas.count(terminal.MASKED) == masked, block
    frames.append((step, num_steps, masked, canvas))
  return frames


def test_frames_count_down_to_the_completion(char_model):
  prompt, new, steps, seed = "Thou", 10, 10, 2
  out = io.StringIO()
  # confidence: new / steps positions a step, so the canvas is full at step K exactly.
  completion = terminal.live(char_model, prompt, max_new_tokens=new, seed=seed,
                             sampler="confidence", knobs={"steps": steps}, out=out)
  frames = frames_of(out.getvalue())
  assert [f[0] for f in frames] == list(range(1, steps + 1))  # K frames, step 1..K
  assert {f[1] for f in frames} == {steps}
  assert [f[2] for f in frames] == [new - k for k in range(1, steps + 1)]  # down to 0
  assert "\x1b[" not in out.getvalue()  # not a terminal: plain frames, one after another
  assert frames[-1][3] == terminal.shown(completion.text)  # one character a token

  from mdjax.serve.engine import Engine
  spec = Engine(char_model).prepare(prompt_ids(char_model, [prompt])[0], max_new_tokens=new,
                                    seed=seed, sampler="confidence",
                                    knobs={"steps": steps}).spec
  offline = mdjax.generate(char_model, [prompt], max_new_tokens=new,
                           key=jax.random.key(seed), spec=spec)[0]
  assert completion.text == offline.text
  assert completion.token_ids.tolist() == offline.token_ids.tolist()
  assert completion.finish_reason == offline.finish_reason


def test_default_sampler_equals_generate(char_model):
  out = io.StringIO()
  completion = terminal.live(char_model, "King", max_new_tokens=8, seed=5,
                             knobs={"steps": 4}, out=out)
  frames = frames_of(out.getvalue())
  masked = [f[2] for f in frames]
  assert masked == sorted(masked, reverse=True) and masked[-1] == 0
  assert 1 <= len(frames) <= 4 and frames[-1][1] == 4  # ancestral may fill early
  offline = mdjax.generate(char_model, ["King"], max_new_tokens=8, key=jax.random.key(5),
                           steps=4)[0]
  assert completion.token_ids.tolist() == offline.token_ids.tolist()
  assert completion.text == offline.text


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_a_terminal_redraws_in_place(char_model):
  out = _Terminal()
  terminal.live(char_model, "Thou", max_new_tokens=6, seed=0, sampler="confidence",
                knobs={"steps": 3}, out=out)
  text = out.getvalue()
  assert text.count("\x1b[J") == 3  # three frames, each clears below the cursor
  assert text.count("\x1b[2F") == 2  # the last two go up over the one before (2 lines)
  assert "step 3/3  masked 0/6" in text


def test_token_text_never_drives_the_terminal(char_model):
  """A token's text is the model's: escape sequences in it (clear the screen, set the
  title, CSI as one C1 byte, a bell) were written to the terminal as they were."""
  hostile = "\x1b[2J\x1b]0;pwned\x07\x9b31m\x00\x7f\r\b"
  model = char_model.replace(decode=lambda ids: hostile)
  out = _Terminal()
  terminal.live(model, "Thou", max_new_tokens=4, seed=0, sampler="confidence",
                knobs={"steps": 2}, out=out)
  text = re.sub(r"(\x1b\[\d+F)?\x1b\[J", "", out.getvalue())  # the screen's own moves
  assert "\x1b[J" in out.getvalue() and "pwned" in text  # drawn, as text
  controls = {c for c in text if unicodedata.category(c) == "Cc"} - {"\n"}
  assert not controls, controls
  assert terminal.shown(hostile) == "\u241b[2J\u241b]0;pwned\u2407<9B>31m\u2400\u2421\u240d\u2408"


def test_bad_arguments_name_the_field(char_model):
  with pytest.raises(ValueError, match="max_new_tokens"):
    terminal.live(char_model, "Thou", max_new_tokens=0, seed=0, out=io.StringIO())
  with pytest.raises(ValueError, match="steps"):
    terminal.live(char_model, "Thou", max_new_tokens=4, seed=0, knobs={"steps": 0},
                  out=io.StringIO())


def test_sample_py_live(trained, sample_cli):
  root, _ = trained
  workdir = str(root / "char")
  run = sample_cli(f"--workdir={workdir}", "--live=Thou", "--max_new_tokens=6",
                   "--sampler=confidence", "--steps=3", "--seed=1")
  assert run.returncode == 0, run.stderr
  assert [f[0] for f in frames_of(run.stdout.split("---")[0].split("\n", 1)[1])] == [1, 2, 3]
  from mdjax.serve.engine import Engine
  model = mdjax.load(workdir)
  spec = Engine(model).prepare(prompt_ids(model, ["Thou"])[0], max_new_tokens=6, seed=1,
                               sampler="confidence", knobs={"steps": 3}).spec
  offline = mdjax.generate(model, ["Thou"], max_new_tokens=6, key=jax.random.key(1),
                           spec=spec)[0]
  assert f"--- 'Thou' -> {offline.text!r} (finish_reason={offline.finish_reason})" in run.stdout
  refused = sample_cli(f"--workdir={workdir}", "--live=Thou", "--max_new_tokens=6",
                       "--prefix=x")
  assert refused.returncode == 1 and "--prefix does not apply with --live" in refused.stderr
  missing = sample_cli(f"--workdir={workdir}", "--live=Thou")
  assert missing.returncode == 1 and "--max_new_tokens" in missing.stderr
  bad = sample_cli(f"--workdir={workdir}", "--live=Thou", "--max_new_tokens=6", "--steps=0")
  assert bad.returncode == 1 and "steps" in bad.stderr
