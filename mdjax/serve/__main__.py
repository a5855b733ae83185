"""`python -m mdjax.serve --model=PATH`: an OpenAI-compatible server for any model
`mdjax.load` reads (a train.py workdir, a published Hugging Face folder, a task's oracle).

  python -m mdjax.serve --model=/data/LLaDA-8B-Instruct --max_batch=16 --steps=64
  python -m mdjax.serve --model=/tmp/shakespeare --port=8001 --api_key=$KEY --sampler=confidence

Sampler flags (sample.py's names, one a knob of the registry `mdjax.knob_registry`, with its
type, help and choices) are the server's defaults: a request's fields override them knob by
knob; without them a knob is `mdjax.generate`'s default for the model. A bad flag is one
line, `mdjax.serve: error: ...`, and exit status 2. SIGTERM (or Ctrl-C) stops
accepting, lets the requests in flight finish, stops the engine, and exits 0.
API: `mdjax.serve.app`; a server inside a Python process: `mdjax.serve.server`;
docs/serving.md.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import NoReturn

from mdjax import cli
from mdjax.errors import ArgumentError

NAME = "mdjax.serve"


ENGINE_FLAGS = ("max_batch", "max_queue", "canvas_length", "max_programs", "max_steps",
                "max_body_bytes", "warm_max_tokens", "prefix_cache_bytes", "max_lane_bytes")


def _flag_bool(text: str) -> bool:
  """A boolean flag's value: --name alone is true, --name=false false."""
  value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
      text.lower())
  if value is None:
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
  return value


def _parser() -> cli.Parser:
  from mdjax.knob_registry import every_knob
  parser = cli.Parser(NAME, prog="python -m mdjax.serve",
                      description="An OpenAI-compatible server over mdjax's serving engine.")
  parser.add_argument("--model", required=True, help="What mdjax.load reads: a train.py "
                      "workdir, a published Hugging Face folder, or a task's oracle name.")
  parser.add_argument("--step", type=int, default=None, help="A workdir's checkpoint step.")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="A published checkpoint's weights' dtype.")
  parser.add_argument("--quantize", choices=("int8", "int4"), default=None,
                      help="Weight-only integer weights of a workdir or a published "
                      "checkpoint (mdjax.load(quantize=...)): matrices stored as int8 (int4) "
                      "with float scales, dequantized where each is used; default float.")
  parser.add_argument("--devices", type=int, default=None, help="Serve on a mesh of this "
                      "many local devices (the weights sharded by the FSDP rule, a lane's "
                      "rows split over them; default: one device).")
  parser.add_argument("--parallel", choices=("fsdp", "tensor", "expert"), default="fsdp",
                      help="Split the weights over --devices (default: every local device) by "
                      "the FSDP rule, or a published Transformer's heads and hidden columns "
                      "(tensor) or LLaDA2's experts (expert) (docs/devices.md).")
  parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default "
                      "127.0.0.1: this machine only).")
  parser.add_argument("--port", type=int, default=8000, help="Port (0: a free one).")
  parser.add_argument("--max_batch", type=int, default=8, help="Rows a compiled program "
                      "advances together (slots of a lane).")
  parser.add_argument("--max_queue", type=int, default=64, help="Rows that may wait for a "
                      "slot; beyond them a request gets 429.")
  parser.add_argument("--canvas_length", type=int, default=None, help="Positions of each "
                      "row's canvas, prompt included (default: the model's length).")
  parser.add_argument("--max_programs", type=int, default=8, help="Lanes (compiled "
                      "programs, one a sampler setting) kept at once; the least recently used "
                      "idle one is dropped, its memory freed, for a new setting.")
  parser.add_argument("--max_lane_bytes", type=int, default=None, help="The most device "
                      "bytes the lanes' rows may hold together: every slot of a lane holds a "
                      "row, with a cached decoder's keys and values, idle ones too. A setting "
                      "whose lane would pass it waits for idle lanes to be dropped; one whose "
                      "lane alone passes it is a 400 (default: no bound).")
  parser.add_argument("--new_programs", choices=("compile", "refuse"), default="compile",
                      help="A request whose setting has no lane: compile one (on a compile "
                      "thread, while the other lanes keep serving) or refuse it with a 400 "
                      "(only the server's defaults, warmed at start for each "
                      "--warm_max_tokens, are served; nothing compiles while serving).")
  parser.add_argument("--warm_max_tokens", default="16", help="With --new_programs=refuse: "
                      "the max_tokens values whose default setting is compiled at start "
                      "(comma separated; default 16, a request's own default).")
  parser.add_argument("--max_steps", type=int, default=None, help="The most denoising steps "
                      "a request may run (steps and the knobs that count steps; default 4 x "
                      "the positions a row holds); more is a 400.")
  parser.add_argument("--prefix_cache_bytes", type=int, default=0, help="Device bytes for the "
                      "block decoders' prompt caches: a prompt whose whole blocks another "
                      "prompt had starts from its keys and values (default 0: none).")
  parser.add_argument("--max_body_bytes", type=int, default=1 << 20, help="The largest request "
                      "body read (default 1 MiB); larger is a 413.")
  parser.add_argument("--allowed_hosts", default=None, help="Host headers answered, separated "
                      "by commas ('*': any; default the --host address, 127.0.0.1, localhost "
                      "and [::1]); another Host is a 400 (DNS rebinding).")
  parser.add_argument("--api_key", default=None, help="Requests need 'Authorization: "
                      "Bearer KEY' (GET /health stays open).")
  parser.add_argument("--served_model_name", default=None, help="The model id clients name "
                      "(default: the --model path's last part).")
  parser.add_argument("--log_level", default="info",
                      choices=("critical", "error", "warning", "info", "debug", "trace"),
                      help="uvicorn's log level (at info, the access log; uvicorn's own "
                      "start and stop lines from debug).")
  parser.add_argument("--sampler", default=None, help="Sampler family (sample.py's "
                      "--sampler; default: the model's default sampler).")
  knobs = parser.add_argument_group("sampler knobs", "The server's defaults (default: the "
                                     "sampler's own).")
  for name, knob in sorted(every_knob().items()):
    if knob.kind is bool:
      knobs.add_argument(f"--{name}", type=_flag_bool, nargs="?", const=True, default=None,
                         metavar="true|false", help=knob.help)
    else:
      knobs.add_argument(f"--{name}", type=knob.kind, choices=knob.choices, default=None,
                         help=knob.help)
  return parser


def _defaults(args) -> dict:
  """The sampler flags given, checked by their knobs' types and ranges: the server's
  defaults."""
  from mdjax.knob_registry import every_knob
  knobs = {name: knob.parse(getattr(args, name)) for name, knob in every_knob().items()
           if getattr(args, name) is not None}
  return ({"sampler": args.sampler} if args.sampler is not None else {}) | knobs


def _warm_max_tokens(text: str) -> list[int]:
  """--warm_max_tokens's values: positive integers, comma separated."""
  try:
    values = [int(part) for part in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise ArgumentError("warm_max_tokens", f"warm_max_tokens={text!r} is invalid: it must be "
                        "positive integers separated by commas.")
  return values


def _usage_error(error: ValueError, flags) -> NoReturn:
  """A ValueError about a setting as a usage error; an `ArgumentError` whose message starts
  with its param, a flag, names the flag (`steps=0 is ...` -> `--steps=0 is ...`)."""
  text, param = str(error), getattr(error, "param", None) or ""
  flag = param.removeprefix("spec.")
  if flag in flags and text.startswith(param):
    text = f"--{flag}{text[len(param):]}"
  cli.fail(NAME, text, cli.USAGE)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  for name, low in (("port", 0), ("max_batch", 1), ("max_queue", 0), ("max_programs", 1),
                    ("max_steps", 1), ("max_body_bytes", 1), ("prefix_cache_bytes", 0),
                    ("max_lane_bytes", 1)):
    value = getattr(args, name)
    if value is None:
      continue
    if value < low or (name == "port" and value > 65535):
      cli.fail(NAME, f"--{name}={value} is invalid: it must be >= {low}"
               + (" and <= 65535" if name == "port" else "") + ".", cli.USAGE)
  import jax
  import uvicorn

  import mdjax
  from mdjax.knob_registry import every_knob
  from mdjax.serve import host_memory, server

  if jax.default_backend() == "cpu":  # each tick's buffers from the heap, not fresh pages
    host_memory.keep_freed_memory()

  flags = {"sampler", "devices", "parallel", *every_knob()}
  try:
    defaults = _defaults(args)
    mesh = None
    if args.devices is not None or args.parallel != "fsdp":
      from mdjax import mesh as mesh_lib
      if args.devices is not None and not 1 <= args.devices <= len(jax.local_devices()):
        raise ArgumentError("devices", f"devices={args.devices} is invalid: it must be in [1, "
                            f"{len(jax.local_devices())}] (the local devices).")
      mesh = mesh_lib.parallel_mesh(args.devices, args.parallel)
    model = mdjax.load(args.model, step=args.step, dtype=args.dtype, mesh=mesh,
                       quantize=args.quantize)
  except ValueError as error:
    _usage_error(error, flags)
  except OSError as error:
    cli.fail(NAME, error, cli.RUNTIME)
  name = args.served_model_name or server.served_name(model, args.model)
  from mdjax.serve.gate import allowed_hosts
  try:
    hosts = allowed_hosts(args.host, args.allowed_hosts)
    engine, app = server.build(model, api_key=args.api_key, defaults=defaults, model_name=name,
                               allowed_hosts=hosts, max_body_bytes=args.max_body_bytes,
                               max_batch=args.max_batch, max_queue=args.max_queue,
                               canvas_length=args.canvas_length,
                               max_programs=args.max_programs, max_steps=args.max_steps,
                               prefix_cache_bytes=args.prefix_cache_bytes,
                               max_lane_bytes=args.max_lane_bytes)
    # The defaults checked against the model before serving: a 1-token request's job.
    knobs = {k: v for k, v in defaults.items() if k != "sampler"}
    probe = knobs.get("block_length") or 1
    engine.prepare([], max_new_tokens=min(probe, engine.canvas_length), seed=0,
                   sampler=defaults.get("sampler"), knobs=knobs or None)
    if args.new_programs == "refuse":
      for max_tokens in _warm_max_tokens(args.warm_max_tokens):
        engine.warm(engine.prepare([], max_new_tokens=max_tokens, seed=0,
                                   sampler=defaults.get("sampler"), knobs=knobs or None))
      engine.freeze()
  except ValueError as error:
    _usage_error(error, flags | set(ENGINE_FLAGS))
  engine.start()

  summary = (f"max_batch={args.max_batch}, max_queue={args.max_queue}, "
             f"canvas_length={engine.canvas_length}, max_programs={args.max_programs}, "
             f"max_lane_bytes={engine.max_lane_bytes or 'none'}, "
             f"new_programs={args.new_programs}, "
             f"max_steps={engine.max_steps}, prefix_cache_bytes={args.prefix_cache_bytes}, "
             f"allowed_hosts={','.join(hosts)}"
             + (", api_key set" if args.api_key else "")
             + "".join(f", {k}={v}" for k, v in defaults.items()))

  class Server(uvicorn.Server):
    async def startup(self, sockets=None):
      await super().startup(sockets)
      if self.started:
        url = server.url_of(args.host, server.bound_port(self) or args.port)
        print(f"serving {name} on {url} ({summary})", flush=True)

  config = server.uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                 timeout_graceful_shutdown=None)
  if args.log_level == "info":  # our one line says where it listens; the access log stays
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
  # uvicorn catches SIGTERM/SIGINT while it serves, shuts down gracefully (stops accepting,
  # waits for the requests in flight, then the app's shutdown drains the engine) and raises
  # the signal again under the handlers it found: these, so that a graceful stop exits 0.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  Server(config).run()
  return 0


if __name__ == "__main__":
  sys.exit(main())
