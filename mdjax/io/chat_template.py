"""A checkpoint's chat template, rendered as Hugging Face's apply_chat_template does, within
bounds: the template comes with the checkpoint and runs as code, so it runs in jinja2's
immutable sandbox with a size cap on every value it builds and on its output, a cap on all the
text it builds, and a deadline (docs/security.md). A template past a bound, or failing, is a
ValueError naming its file."""

from __future__ import annotations

import functools
import json
import os
import re
import string
import time
from typing import Sequence

from jinja2 import sandbox
from jinja2.compiler import CodeGenerator
from jinja2.utils import Namespace

from mdjax import files as files_lib

# Where a folder keeps its template: its own file, or tokenizer_config.json's chat_template.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

def _special_token(special: dict, key: str, where: str) -> str:
  """A tokenizer_config.json special token: a string or {"content": ...}."""
  value = special.get(key)
  if isinstance(value, dict):
    value = value.get("content", "")
  if value is not None and not isinstance(value, str):
    raise ValueError(f"{where}: {key} is a {type(value).__name__}, not a string or "
                     "{\"content\": string}")
  return value or ""


# Bounds on rendering a chat template, which comes with the checkpoint and runs as code: a
# chat prompt is kilobytes, so a template that asks for far more is refused, not run.
MAX_TEMPLATE_CHARS = 1_000_000  # its source, its output, and any one value it builds
MAX_TEMPLATE_WORK = 50_000_000  # all the text one rendering builds: its memory, in effect
TEMPLATE_DEADLINE_S = 2.0
# The deadline is checked between operations, so no one operation may outlast it: big-integer
# arithmetic (CPython's `//` and `%` are quadratic in the digits: 10**999999 // (10**499999 + 1)
# takes seconds) is refused on integers, or products and powers, of over this many bits. About
# 4,900 decimal digits: past the 4,300 that Python will turn into text at all; one operation on
# such integers takes well under a millisecond.
MAX_TEMPLATE_INT_BITS = 16_384
MAX_TOJSON_INDENT = 16
# Filters no chat template needs whose output grows as a product of their inputs (striptags:
# a regex quadratic in its input): left out.
_DROPPED_FILTERS = ("striptags", "urlize", "wordwrap", "xmlattr")
# Filters that never turn their arguments into text; the others' are bounded first.
_STRUCTURAL_FILTERS = frozenset((
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
    "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
    "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum",
    "unique"))
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d*)(?:\.(\*|\d*))?")


class _TemplateLimit(Exception):
  """A chat template went past one of the bounds above."""


class _Refused(Exception):
  """The chat template's own raise_exception."""


def _text_size(value, limit: int = MAX_TEMPLATE_CHARS) -> int:
  """About how many characters `value`'s text has (a container's: its items'), counted only to
  just past `limit`."""
  if isinstance(value, (str, bytes)):
    return len(value)
  if isinstance(value, int):
    return value.bit_length() // 3 + 1
  items = value._Namespace__attrs if isinstance(value, Namespace) else value  # namespace()
  if isinstance(items, dict):
    items = [x for pair in items.items() for x in pair]
  if not isinstance(items, (list, tuple, set, frozenset)):
    return 8
  total = 2
  for item in items:
    total += 2 + _text_size(item, limit - total)
    if total > limit:
      break
  return total


def _padding(fmt: str, percent: bool) -> int:
  """The most characters the widths and precisions of a %- or {}-format string can add."""
  specs = ([f"{m.group(1)} {m.group(2) or ''}" for m in _PERCENT_SPEC.finditer(fmt)] if percent
           else [spec or "" for _, _, spec, _ in string.Formatter().parse(fmt)])
  if any("*" in spec or "{" in spec for spec in specs):
    return MAX_TEMPLATE_CHARS + 1  # a width taken from the arguments
  return sum(int(n) for spec in specs for n in re.findall(r"\d+", spec))


def _replaced(s, old, new) -> int:
  return len(s) + (s.count(old) if old else len(s) + 1) * len(new)


# The most characters a string method, or a filter, whose output can outgrow its input
# returns, from its arguments (the string or value first): bounded before it runs.
_METHOD_BOUNDS = {
    "center": lambda s, width, *_: max(len(s), width),
    "ljust": lambda s, width, *_: max(len(s), width),
    "rjust": lambda s, width, *_: max(len(s), width),
    "zfill": lambda s, width: max(len(s), width),
    "expandtabs": lambda s, tabsize=8: len(s) * max(1, tabsize),
    "replace": lambda s, old, new, *_: _replaced(s, old, new),
    "join": lambda s, items: len(s) * len(items) + _text_size(items),
    "format": lambda s, *args, **kwargs: (len(s) + _padding(s, False) + _text_size(args)
                                          + _text_size(kwargs)),
    "format_map": lambda s, mapping: len(s) + _padding(s, False) + _text_size(mapping),
    "translate": lambda s, table: MAX_TEMPLATE_CHARS + 1,  # a table maps a character to any text
}
_FILTER_BOUNDS = {
    "center": lambda value, width=80: max(_text_size(value), width),
    "indent": lambda s, width=4, first=False, blank=False: _text_size(s) + (
        width if isinstance(width, int) else len(width)) * (str(s).count("\n") + 1),
    "format": lambda value, *args, **kwargs: (_text_size(value) + _padding(str(value), True)
                                              + _text_size(args) + _text_size(kwargs)),
    "replace": lambda s, old, new, count=None: _replaced(str(s), str(old), str(new)),
    "join": lambda items, d="", attribute=None: len(str(d)) * len(items) + _text_size(items),
    "batch": lambda value, linecount, fill_with=None: linecount,
    "slice": lambda value, slices, fill_with=None: slices,
}


class _CheckedCode(CodeGenerator):
  """Jinja's code generator with a deadline check opening every block (each loop iteration,
  branch and macro call), and `~` joined by the environment, which bounds it first."""

  def blockvisit(self, nodes, frame):
    self.writeline("environment.tick()")
    super().blockvisit(nodes, frame)

  def visit_Concat(self, node, frame):
    self.write("environment.concat_text((")
    for arg in node.nodes:
      self.visit(arg, frame)
      self.write(", ")
    self.write("))")


class _BoundedSandbox(sandbox.ImmutableSandboxedEnvironment):
  """Jinja's immutable sandbox within the bounds above: the deadline checked at every block,
  call, attribute, item and operator; every value that can grow (*, +, %, **, ~, string
  methods, filters, tojson) bounded before it is built, every value built counted."""

  code_generator_class = _CheckedCode
  intercepted_binops = frozenset(("*", "+", "-", "%", "**", "//", "/"))

  def __init__(self, **options):
    super().__init__(finalize=self.built, **options)
    self.deadline = time.monotonic() + TEMPLATE_DEADLINE_S
    self.work = 0
    del self.globals["lipsum"]  # lipsum(n) writes n paragraphs
    self.filters["tojson"] = self.tojson
    self.filters = {name: self._bounded_filter(name, fn) for name, fn in self.filters.items()
                    if name not in _DROPPED_FILTERS}

  def tick(self):
    if time.monotonic() > self.deadline:
      raise _TemplateLimit(f"ran past its {TEMPLATE_DEADLINE_S:g} s deadline")

  def charge(self, size: int):
    """Counts a value of `size` characters, about to be built, against the bounds."""
    self.work += size
    if size > MAX_TEMPLATE_CHARS:
      raise _TemplateLimit(f"builds a value of over {MAX_TEMPLATE_CHARS:,} characters")
    if self.work > MAX_TEMPLATE_WORK:
      raise _TemplateLimit(f"builds over {MAX_TEMPLATE_WORK:,} characters in all")

  def built(self, value):
    self.charge(_text_size(value))
    return value

  def concat_text(self, parts) -> str:
    """`a ~ b`: the parts' text joined (jinja's str_join), its size bounded first."""
    self.charge(sum(_text_size(p) for p in parts))
    return "".join(map(str, parts))

  def call_binop(self, context, operator, left, right):
    self.tick()
    ints = isinstance(left, int) and isinstance(right, int)
    if ints:
      self.check_int_bits(operator, left, right)
    if operator == "**" and ints and right > 0:  # the power's digits
      self.charge(right * max(abs(left).bit_length() - 1, 0) // 3)
    elif operator == "*" and not ints and isinstance(right, int):
      self.charge(_text_size(left) * max(right, 0))
    elif operator == "*" and not ints and isinstance(left, int):
      self.charge(_text_size(right) * max(left, 0))
    elif operator in ("*", "+") or (operator == "%" and isinstance(left, str)):
      padding = _padding(left, True) if operator == "%" else 0
      self.charge(_text_size(left) + _text_size(right) + padding)
    return super().call_binop(context, operator, left, right)

  @staticmethod
  def check_int_bits(operator: str, left: int, right: int):
    """Refuses integer arithmetic on, or making, integers of over MAX_TEMPLATE_INT_BITS bits,
    before it runs."""
    bits = max(abs(left).bit_length(), abs(right).bit_length())
    if operator == "*":
      bits = abs(left).bit_length() + abs(right).bit_length()
    elif operator == "**" and right > 0 and abs(left) > 1:
      bits = max(bits, right * (abs(left).bit_length() - 1) + 1)  # (at least: fits in int)
    if bits > MAX_TEMPLATE_INT_BITS:
      raise _TemplateLimit(f"computes with an integer of over {MAX_TEMPLATE_INT_BITS:,} bits "
                           f"({operator!r}; at most {MAX_TEMPLATE_INT_BITS:,})")

  def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's signature)
    __self.tick()
    owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", None)
    if isinstance(owner, (str, bytes)) and name in _METHOD_BOUNDS:
      if name == "join" and args:
        args = (list(args[0]), *args[1:])
      __self.charge(_METHOD_BOUNDS[name](owner, *args, **kwargs))
    elif isinstance(owner, int) and name == "to_bytes":  # (5).to_bytes(10**9): its length
      length = args[0] if args else kwargs.get("length", 1)
      __self.charge(length if isinstance(length, int) else 0)
    return __self.built(super().call(__context, __obj, *args, **kwargs))

  def getattr(self, obj, attribute):
    self.tick()
    return super().getattr(obj, attribute)

  def getitem(self, obj, argument):
    self.tick()
    return super().getitem(obj, argument)

  def wrap_str_format(self, value):
    # jinja2 >= 3.1.5 wraps str.format where it is looked up, so `call` never sees the method.
    wrapped = super().wrap_str_format(value)
    if wrapped is None:
      return None

    def bounded(*args, **kwargs):
      self.charge(_METHOD_BOUNDS[value.__name__](value.__self__, *args, **kwargs))
      return wrapped(*args, **kwargs)
    return bounded

  def _bounded_filter(self, name: str, fn):
    first = 1 if hasattr(fn, "jinja_pass_arg") else 0  # (a context or environment first)

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
      self.tick()
      if name not in _STRUCTURAL_FILTERS:
        self.charge(_text_size(args[first:]) + _text_size(kwargs))
      if name == "join" and len(args) > first:
        args = (*args[:first], list(args[first]), *args[first + 1:])
      if name in _FILTER_BOUNDS:
        self.charge(_FILTER_BOUNDS[name](*args[first:], **kwargs))
      return self.built(fn(*args, **kwargs))
    return bounded

  def tojson(self, x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Hugging Face's tojson (transformers' _compile_jinja_template), its indent bounded and
    its text streamed within the size bound."""
    width = len(indent) if isinstance(indent, str) else indent or 0
    if not isinstance(width, int) or width > MAX_TOJSON_INDENT:
      raise _TemplateLimit(f"asks tojson for indent={indent!r} (at most {MAX_TOJSON_INDENT})")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    parts, size = [], 0
    for part in encoder.iterencode(x):  # (not one-shot: pieces, even where indent is None)
      size += len(part)
      if size > MAX_TEMPLATE_CHARS:
        raise _TemplateLimit(f"builds a value of over {MAX_TEMPLATE_CHARS:,} characters")
      parts.append(part)
    return "".join(parts)


def _template_file(model) -> str:
  """The file a model's chat template was read from, for messages."""
  if not model.source:
    return "<chat template>"
  path = os.path.join(model.source, CHAT_TEMPLATE_FILE)
  return path if os.path.isfile(path) else os.path.join(model.source,
                                                        TOKENIZER_CONFIG_FILE)


def render_chat(model, messages: Sequence[dict[str, str]]) -> str:
  """The checkpoint's chat template applied to `messages` ([{"role", "content"}]), with the
  assistant's turn opened (add_generation_prompt), as Hugging Face's apply_chat_template.

  The template runs in a sandbox within the bounds above; a template that goes past one, or
  fails, is a ValueError naming its file."""
  if model.chat_template is None:
    raise ValueError("chat=True needs the checkpoint's chat template (tokenizer_config.json "
                     "'chat_template' or chat_template.jinja); this folder has none.")
  special = {}
  config_path = os.path.join(model.source or "", TOKENIZER_CONFIG_FILE)
  if model.source and files_lib.regular_file(config_path):
    special = files_lib.read_json(config_path, "JSON")
  bos_token, eos_token = (_special_token(special, key, config_path)
                          for key in ("bos_token", "eos_token"))
  where = _template_file(model)

  def raise_exception(message):
    raise _Refused(f"{where}: the chat template refused the messages: {message}")

  try:
    if len(model.chat_template) > MAX_TEMPLATE_CHARS:
      raise _TemplateLimit(f"is over {MAX_TEMPLATE_CHARS:,} characters long")
    # jinja2's default Undefined, as transformers renders: the Qwen templates test names a
    # plain chat leaves out (`message.tool_calls`), which must read as false.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(model.chat_template)
    out, size = [], 0
    # tools and documents as transformers passes them when none are given.
    for chunk in template.generate(messages=list(messages), add_generation_prompt=True,
                                   bos_token=bos_token, eos_token=eos_token, tools=None,
                                   documents=None):
      size += len(chunk)
      if size > MAX_TEMPLATE_CHARS:
        raise _TemplateLimit(f"renders over {MAX_TEMPLATE_CHARS:,} characters")
      out.append(chunk)
    return "".join(out)
  except _Refused as e:
    raise ValueError(str(e)) from None
  except _TemplateLimit as e:
    raise ValueError(f"{where}: the chat template {e}") from None
  except RecursionError:
    raise ValueError(f"{where}: the chat template recurses too deeply") from None
  except Exception as e:  # a syntax error, an undefined name, a sandbox refusal, ...
    raise ValueError(f"{where}: the chat template failed ({type(e).__name__}: {e})") from e
