"""A published folder from an untrusted source: config.json counts that cost before any tensor
is read, deep or mistyped JSON, a tokenizer.json that panics the tokenizers library, chat
templates that ask for gigabytes or never end, FIFOs named like checkpoint files, auto_map
paths and symbolic links that reach outside the folders `save` reads and writes, duplicate
safetensors keys. Each is refused with one ValueError naming the file (and the field or
tensor), within a stated time and memory, before anything outside the folder is touched.

Nothing here compiles: every refusal comes before the params are built."""

import json
import os
import re
import shutil
import time
import types

import numpy as np
import pytest

from mdjax import formats, io
from mdjax.io import chat_template as chat_template_lib
from mdjax.io import record, tensors
from mdjax.models import published
from mdjax.models.dit import DiTConfig
from tests import attacks
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "pretrained")
HI = [{"role": "user", "content": "Hi"}]

def refused(fn, match, *, seconds=10.0, peak_mb=32):
  """fn() raises one one-line ValueError matching `match` within `seconds` and `peak_mb` MB of
  Python allocations (tracemalloc's peak: numpy arrays, bytes and str all report there).
  Returns the seconds it took."""
  start = time.monotonic()
  with attacks.deadline(seconds):
    error, peak = attacks.peak_bytes(fn)
  assert isinstance(error, ValueError) and re.search(match, str(error)), error
  assert "\n" not in str(error)
  assert peak < peak_mb * 2**20, f"peak {peak / 2**20:.0f} MB"
  return time.monotonic() - start


@pytest.fixture
def folder(tmp_path):
  """A copy of a tiny published folder to tamper with (its parent is 'outside')."""
  def make(family="llada"):
    return str(shutil.copytree(os.path.join(FIXTURES, family), tmp_path / family))
  return make


def edit_json(path, **changes):
  with open(path) as f:
    raw = json.load(f)
  raw.update(changes)
  with open(path, "w") as f:
    json.dump(raw, f)


def write_header(path, header_text: str, data=b""):
  raw = header_text.encode()
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + data)


# --- config.json: bounds before work ------------------------------------------------------


@pytest.mark.parametrize("family, key", [("llada", "n_layers"), ("dream", "num_hidden_layers")])
def test_huge_layer_count_fails_fast(folder, family, key):
  path = folder(family)
  edit_json(os.path.join(path, "config.json"), **{key: 10**6})
  took = refused(lambda: io.load(path), f"config.json: {key}=1000000 but the "
                 "checkpoint holds tensors for 2 layers", peak_mb=8)
  assert took < 5


@pytest.mark.parametrize("family, change, match", [
    ("llada", dict(n_heads=0), "llada config.json: n_heads=0 must be >= 1"),
    ("dream", dict(num_attention_heads=0), "dream config.json: num_attention_heads=0"),
    ("llada", dict(n_kv_heads=0), "llada config.json: num_kv_heads=0"),
    ("dream", dict(num_key_value_heads=3), "dream config.json: num_heads=4 must be a multiple"),
    ("llada", dict(rope_theta=10**400), "llada config.json: rope_theta=1000.* is not a finite"),
    ("llada", dict(model_type=None, architectures=5), "unsupported model_type=None"),
])
def test_config_fields_checked_before_arithmetic(folder, family, change, match):
  path = folder(family)
  edit_json(os.path.join(path, "config.json"), **change)
  refused(lambda: io.load(path), match)


def test_adaln_free_checkpoint_cannot_ask_for_huge_cond_dim(tmp_path):
  """Without adaLN tensors the adaLN terms are built as zeros sized by cond_dim, which no
  tensor bounds: 10**6 would be terabytes."""
  config = DiTConfig(family="mdlm", vocab_size=30, hidden_dim=16, cond_dim=8, n_blocks=2,
                     n_heads=2, model_length=16)
  layout = formats.FORMATS["mdlm"]
  named = {n: np.zeros(formats.base.hf_shape(config, leaf), np.float32)
           for leaf in layout.leaves(config, adaln=False) for n in leaf.hf_names(2)}
  tensors.write_file(str(tmp_path / "model.safetensors"), named)
  raw = {**layout.config_to_hf(config), "adaln": False, "cond_dim": 10**6}
  tensors.write_json(str(tmp_path / "config.json"), raw)
  refused(lambda: io.load(tmp_path), "mdlm config.json: cond_dim=1000000 with adaln "
          "false builds .* zero adaLN values, more than the checkpoint's", peak_mb=8)


# --- JSON: nesting and types ---------------------------------------------------------------


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json",
                                  "model.safetensors.index.json"])
def test_deeply_nested_json(folder, name):
  path = folder()
  with open(os.path.join(path, name), "w") as f:
    f.write(DEEP)
  refused(lambda: io.load(path), f"{name}: unreadable .*nested too deeply")


def test_deeply_nested_safetensors_header(tmp_path):
  write_header(tmp_path / "deep.safetensors", DEEP)
  refused(lambda: tensors.read_header(str(tmp_path / "deep.safetensors")),
          "deep.safetensors: corrupt safetensors header .*nested too deeply")


@pytest.mark.parametrize("config, match", [
    ([1, 2], "tokenizer_config.json: not a JSON object"),  # a list where the object belongs
    ({"bos_token": ["<s>"]}, "tokenizer_config.json: bos_token is a list"),
    ({"eos_token": {"content": 5}}, "tokenizer_config.json: eos_token is a int"),
])
def test_mistyped_tokenizer_config_beside_a_chat_template(tmp_path, config, match):
  (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  view = types.SimpleNamespace(chat_template="{{ bos_token }}{{ messages[0].content }}",
                               source=str(tmp_path))
  refused(lambda: io.render_chat(view, HI), match)


@pytest.mark.parametrize("template, match", [
    (5, "chat_template is a int, not a string"),
    ([{"name": "default", "template": 5}], "chat_template is a int"),
    (["{{ x }}"], "chat_template is a list whose items are not all"),
])
def test_mistyped_chat_template_field(folder, template, match):
  path = folder()
  edit_json(os.path.join(path, "tokenizer_config.json"), chat_template=template)
  refused(lambda: io.load(path), f"tokenizer_config.json: {match}")


def test_tokenizer_panic_is_a_value_error(folder):
  """tokenizers panics (pyo3's PanicException, a BaseException) on a Precompiled normalizer
  whose charsmap does not parse."""
  path = folder()
  edit_json(os.path.join(path, "tokenizer.json"),
            normalizer={"type": "Precompiled", "precompiled_charsmap": ""})
  refused(lambda: io.load(path), "tokenizer.json: unreadable tokenizer "
          r"\(PanicException: Precompiled")


# --- chat templates --------------------------------------------------------------------------


def _render(tmp_path, template):
  (tmp_path / "chat_template.jinja").write_text(template)
  view = types.SimpleNamespace(chat_template=template, source=str(tmp_path))
  return lambda: io.render_chat(view, HI)


@pytest.mark.parametrize("template, match", [
    ("{{ 'x' * 10**9 }}", "builds a value of over 1,000,000 characters"),
    ("{{ messages|tojson(indent=10**8) }}", "asks tojson for indent=100000000 "
     r"\(at most 16\)"),
    ("{{ 'x'|center(10**8) }}", "builds a value of over"),
    ("{{ '{:>100000000}'.format('x') }}", "builds a value of over"),
    ("{{ '%100000000s' % 'x' }}", "builds a value of over"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "renders over 1,000,000"),
    ("{% set ns = namespace(s='x') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "builds a value of over"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
     "{% set ns.l = ns.l + ['x' * 1000] %}{% endfor %}", "builds over 50,000,000 characters"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deeply"),
])
def test_chat_template_bombs(tmp_path, template, match):
  refused(_render(tmp_path, template), f"chat_template.jinja: the chat template {match}")


@pytest.mark.slow
def test_chat_template_loops_meet_a_deadline(tmp_path):
  """Nested loops (each range within the sandbox's 100000) multiply: the deadline stops
  them, whether they call range or iterate a string."""
  for template in ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                   "{% endfor %}",
                   "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                   "{% endfor %}"):
    took = refused(_render(tmp_path, template), "chat_template.jinja: the chat template ran "
                   f"past its {chat_template_lib.TEMPLATE_DEADLINE_S:g} s deadline")
    assert took < chat_template_lib.TEMPLATE_DEADLINE_S + 3


# Each took seconds in one operation, which the deadline (checked between operations) cannot
# stop: the review's three `//` ran 20.9 s; here the `//` list took 4.6 s and the `%` 5.0 s.
@pytest.mark.parametrize("template", [
    "{{ [10**999999 // (10**499999 + 1), 10**999999 // (10**499999 + 3), "
    "10**999999 // (10**499999 + 7)] }}",
    "{{ [10**100000 // 3, 10**100000 // 7, 10**100000 // 9] }}",
    "{{ (10**999999) % (10**499999 + 1) }}",
    "{{ 2**(2**30) }}",
    "{{ (10**4000) * (10**4000) * (10**4000) }}",
    "{% set ns = namespace(x=10**4000) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}{{ ns.x // 7 }}",
])
def test_chat_template_big_integers_are_bounded(tmp_path, template):
  bits = f"{chat_template_lib.MAX_TEMPLATE_INT_BITS:,}"
  took = refused(_render(tmp_path, template), "chat_template.jinja: the chat template computes "
                 f"with an integer of over {bits} bits")
  assert took < chat_template_lib.TEMPLATE_DEADLINE_S + 0.5


def test_chat_template_small_integers_render(tmp_path):
  template = ("{{ 7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ 7 - 9 }} {{ 2 ** 10 }} {{ 2 ** -1 }} "
              "{{ (10**4000 * 3 - 10**4000) // 10**3999 }} {{ (5).to_bytes(2, 'big')|length }}")
  assert _render(tmp_path, template)() == "3 1 3.5 -2 1024 0.5 20 2"
  refused(_render(tmp_path, "{{ (5).to_bytes(10**8, 'big') }}"), "builds a value of over")


def test_chat_template_renders_as_before(tmp_path):
  template = ("{% for m in messages %}{{ '<' + m['role'] + '>' ~ m['content']|trim }}"
              "{{ '%s|%d' % ('a', loop.index) }}{{ '{}'.format(m['role']) }}{% endfor %}"
              "{{ messages|tojson(indent=2, sort_keys=True) }}")
  assert _render(tmp_path, template)() == (
      "<user>Hia|1user" + json.dumps(HI, indent=2, sort_keys=True))


# --- FIFOs -------------------------------------------------------------------------------------


def test_fifo_named_like_a_checkpoint_is_never_opened(tmp_path):
  os.mkfifo(tmp_path / "x.ckpt")
  config = json.load(open(os.path.join(FIXTURES, "llada", "config.json")))
  refused(lambda: io.load(tmp_path, config=config), "x.ckpt: not a regular file",
          seconds=5)
  refused(lambda: io.load(tmp_path / "x.ckpt", config=config),
          "x.ckpt: not a regular file", seconds=5)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "model.safetensors"])
def test_fifo_in_a_folder_is_refused(folder, name):
  path = folder()
  os.remove(os.path.join(path, name))
  os.mkfifo(os.path.join(path, name))
  refused(lambda: io.load(path), f"{name}: not a regular file", seconds=5)


def test_fifo_as_config_argument(tmp_path, folder):
  path = folder()
  os.mkfifo(tmp_path / "config.json")
  refused(lambda: io.load(path, config=str(tmp_path / "config.json")),
          "config.json: not a regular file", seconds=5)


# --- save: what it reads and where it writes ---------------------------------------------------


def tiny_model(source, hf_config=None, **kw):
  """A published Model of zeros from `source` (built by hand: nothing is loaded or compiled)."""
  config = published.PublishedConfig(
      family="llada", vocab_size=64, d_model=16, num_layers=2, num_heads=4, num_kv_heads=4,
      head_dim=4, mlp_hidden=24, rope_theta=1e4, norm_eps=1e-5, qkv_bias=False,
      logit_shift=False, mask_id=63, eos_id=1)
  params = {k: {kk: np.zeros(vv, np.float32) for kk, vv in v.items()} if isinstance(v, dict)
            else np.zeros(v, np.float32) for k, v in published.param_shapes(config).items()}
  raw = hf_config or formats.FORMATS["llada"].config_to_hf(config)
  return record.published_model(params=params, config=config, family="llada",
                                source=str(source), hf_config=raw, **kw)


def test_auto_map_cannot_name_files_outside(tmp_path):
  source, out = tmp_path / "s1" / "s2" / "source", tmp_path / "o1" / "o2" / "out"
  source.mkdir(parents=True)
  (tmp_path / "s1" / "x.py").write_text("secret")
  (tmp_path / "o1").mkdir()
  (tmp_path / "o1" / "x.py").write_text("victim")
  raw = {**formats.FORMATS["llada"].config_to_hf(tiny_model(source).config),
         "auto_map": {"AutoModel": "../../x.Evil"}}
  with attacks.recording_opens() as opened:
    refused(lambda: io.save(tiny_model(source, raw), out),
            "config.json: auto_map entry '../../x.Evil' does not name a module file")
  assert (tmp_path / "o1" / "x.py").read_text() == "victim"
  assert str(tmp_path / "s1" / "x.py") not in opened and not out.exists()


def test_save_refuses_a_symlinked_side_file(tmp_path):
  source = tmp_path / "source"
  source.mkdir()
  (tmp_path / "secret.json").write_text('{"key": "secret"}')
  os.symlink(tmp_path / "secret.json", source / "special_tokens_map.json")
  refused(lambda: io.save(tiny_model(source), tmp_path / "out"),
          "special_tokens_map.json: a symbolic link; save copies only regular files")
  assert not (tmp_path / "out").exists()


def test_save_replaces_links_planted_in_the_output(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  source, out = tmp_path / "source", tmp_path / "out"
  source.mkdir()
  out.mkdir()
  (source / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
  for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
    (tmp_path / f"victim-{name}").write_text("victim")
    os.symlink(tmp_path / f"victim-{name}", out / name)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
  io.save(tiny_model(source, tokenizer=tokenizer), out)
  for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
    assert (tmp_path / f"victim-{name}").read_text() == "victim"
    assert not os.path.islink(out / name) and os.path.getsize(out / name) > 6
  assert json.load(open(out / "tokenizer_config.json")) == {"bos_token": "<s>"}


def test_save_writes_the_template_through_no_link(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (tmp_path / "victim").write_text("victim")
  os.symlink(tmp_path / "victim", out / "chat_template.jinja")
  model = tiny_model(tmp_path / "gone", chat_template="{{ messages }}")
  io.save(model, out)
  assert (tmp_path / "victim").read_text() == "victim"
  assert (out / "chat_template.jinja").read_text() == "{{ messages }}"


# --- safetensors: duplicate keys -------------------------------------------------------------


ENTRY = '{"dtype": "F32", "shape": [1], "data_offsets": [%d, %d]}'


def test_duplicate_key_in_one_header(tmp_path):
  write_header(tmp_path / "dup.safetensors",
               '{"a": %s, "a": %s}' % (ENTRY % (0, 4), ENTRY % (4, 8)), bytes(8))
  refused(lambda: tensors.read_header(str(tmp_path / "dup.safetensors")),
          "dup.safetensors: corrupt safetensors header: key 'a' is listed twice")


def test_tensor_stored_in_two_shards(tmp_path):
  one, two = np.zeros(1, np.float32), np.ones(1, np.float32)
  tensors.write_file(str(tmp_path / "s1.safetensors"), {"a": one})
  tensors.write_file(str(tmp_path / "s2.safetensors"), {"a": two, "b": one})
  tensors.write_json(str(tmp_path / "model.safetensors.index.json"),
                     {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
  refused(lambda: tensors.read_checkpoint(str(tmp_path)), "index.json: tensor 'a' is stored "
          "in two shards, 's1.safetensors' and 's2.safetensors'")


def test_duplicate_key_in_the_index(tmp_path):
  tensors.write_file(str(tmp_path / "s1.safetensors"), {"a": np.zeros(1, np.float32)})
  (tmp_path / "model.safetensors.index.json").write_text(
      '{"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}}')
  refused(lambda: tensors.read_checkpoint(str(tmp_path)),
          "index.json: key 'a' appears twice")
