"""The OpenAI-compatible server (`python -m mdjax.serve`, `mdjax.serve.app`), driven as its
users drive it: a real uvicorn server on a free port, the `openai` client, raw HTTP for what
the client will not send. Served completions equal `mdjax.generate` offline, token for
token, alone or among concurrent requests."""

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import openai
import pytest

import mdjax
from tests.devices import cpu_devices_env
from tests.paths import REPO
from tests.serve.conftest import DREAM, running_server

KNOBS = {"steps": 4, "temperature": 1.0}  # random draws: the seed decides the tokens


def client(server, **kwargs) -> openai.OpenAI:
  kwargs.setdefault("api_key", "unused")
  return openai.OpenAI(base_url=server.base_url, max_retries=0, timeout=60, **kwargs)


def offline(server, prompt_ids, *, max_tokens, seed, n=1, sampler=None, knobs=None):
  """What the exactness rule says a request gets: (the job, generate's completions)."""
  job = server.engine.prepare(np.asarray(prompt_ids, np.int32), max_new_tokens=max_tokens,
                              seed=seed, n=n, sampler=sampler, knobs=knobs)
  out = mdjax.generate(server.model, [job.prompt_ids] * n, max_new_tokens=max_tokens,
                       key=jax.random.key(seed), spec=job.spec)
  return job, out


def ids_of(choice) -> list[int]:
  return choice.model_extra["mdjax"]["token_ids"]


def chat_ids(model, messages):
  return mdjax.generation.prompt_ids(model, [messages])[0]


@pytest.mark.slow
def test_completions_equal_offline_generate(server):
  api = client(server)
  out = api.completions.create(model="dream", prompt="Hello", max_tokens=8, seed=11, n=2,
                               extra_body=KNOBS)
  job, expected = offline(server, server.model.encode("Hello"), max_tokens=8, seed=11, n=2,
                          knobs=KNOBS)
  assert [c.index for c in out.choices] == [0, 1]
  for choice, completion in zip(out.choices, expected):
    assert ids_of(choice) == completion.token_ids.tolist()
    assert choice.text == completion.text
    assert choice.finish_reason == completion.finish_reason
  extension = out.model_extra["mdjax"]
  assert extension == {"seed": 11, "spec": repr(job.spec), "steps": job.num_steps}
  assert out.usage.prompt_tokens == 5
  assert out.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
  assert out.usage.total_tokens == 5 + out.usage.completion_tokens
  assert out.object == "text_completion" and out.model == "dream"
  # Token ids in, a batch of one prompt, a fresh seed returned when none is given.
  again = api.completions.create(model="dream", prompt=[[40, 69, 76, 76, 79]], max_tokens=8,
                                 seed=11, n=2, extra_body=KNOBS)
  assert [ids_of(c) for c in again.choices] == [ids_of(c) for c in out.choices]
  fresh = api.completions.create(model="dream", prompt="Hello", max_tokens=8, extra_body=KNOBS)
  seed = fresh.model_extra["mdjax"]["seed"]
  _, expected = offline(server, server.model.encode("Hello"), max_tokens=8, seed=seed,
                        knobs=KNOBS)
  assert ids_of(fresh.choices[0]) == expected[0].token_ids.tolist()


@pytest.mark.slow
def test_a_batch_of_prompts_equals_each_prompt_offline(server):
  """OpenAI's batch: `prompt` a list of texts or of id lists. Prompt i runs with seed + i;
  its n choices follow the n of each prompt before it (index i * n + j), each equal to
  `mdjax.generate` of that prompt alone with its seed."""
  api = client(server)
  prompts, seed, n = ["Hello", [40, 69], "Hi"], 21, 1
  ids = [server.model.encode("Hello"), [40, 69], server.model.encode("Hi")]
  expected = [offline(server, p, max_tokens=6, seed=seed + i, n=n, knobs=KNOBS)[1][0]
              for i, p in enumerate(ids)]
  out = api.completions.create(model="dream", prompt=prompts, max_tokens=6, seed=seed,
                               extra_body=KNOBS)
  assert [c.index for c in out.choices] == [0, 1, 2]
  assert [ids_of(c) for c in out.choices] == [e.token_ids.tolist() for e in expected]
  assert [c.text for c in out.choices] == [e.text for e in expected]
  assert [c.model_extra["mdjax"]["seed"] for c in out.choices] == [21, 22, 23]
  assert out.usage.prompt_tokens == sum(len(p) for p in ids)
  streamed = {}
  for chunk in api.completions.create(model="dream", prompt=prompts, max_tokens=6,
                                      seed=seed, stream=True, extra_body=KNOBS):
    for c in chunk.choices:
      if c.finish_reason:
        streamed[c.index] = ids_of(c)
  assert [streamed[i] for i in range(3)] == [ids_of(c) for c in out.choices]
  two = api.completions.create(model="dream", prompt=["Hello", "Hi"], max_tokens=6, seed=seed,
                               n=2, extra_body=KNOBS)  # index i * n + j
  hi = offline(server, ids[2], max_tokens=6, seed=seed + 1, n=2, knobs=KNOBS)[1]
  assert [ids_of(c) for c in two.choices[2:]] == [e.token_ids.tolist() for e in hi]


@pytest.mark.slow
def test_chat_streamed_and_not_equal_offline(server):
  api = client(server)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  kwargs = dict(model="dream", messages=messages, max_tokens=12, seed=5, extra_body=KNOBS)
  whole = api.chat.completions.create(**kwargs)
  job, expected = offline(server, chat_ids(server.model, messages), max_tokens=12, seed=5,
                          knobs=KNOBS)
  assert whole.object == "chat.completion"
  assert whole.choices[0].message.role == "assistant"
  assert whole.choices[0].message.content == expected[0].text
  assert ids_of(whole.choices[0]) == expected[0].token_ids.tolist()
  assert whole.model_extra["mdjax"]["spec"] == repr(job.spec)

  chunks = list(api.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == expected[0].text
  finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
  assert len(finals) == 1 and finals[0].choices[0].finish_reason == expected[0].finish_reason
  assert ids_of(finals[0].choices[0]) == expected[0].token_ids.tolist()
  assert chunks[0].choices[0].delta.role == "assistant"
  assert chunks[-1].usage.completion_tokens == len(expected[0].token_ids)
  assert chunks[-1].usage.prompt_tokens == len(job.prompt_ids)


@pytest.mark.slow
def test_streamed_completions_commit_text_and_cut_at_stop(server):
  api = client(server)
  base = dict(model="dream", prompt="Hello", max_tokens=16, seed=2,
              extra_body={"steps": 16, "temperature": 1.0})
  whole = api.completions.create(**base)
  full = whole.choices[0].text
  streamed = list(api.completions.create(stream=True, **base))
  assert "".join(c.choices[0].text for c in streamed) == full
  assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
  # A stop string taken from the middle of the text: cut before it, streamed or not.
  visible = full.replace("\ufffd", "")
  stop = next((visible[i:i + 2] for i in range(1, len(visible) - 1)
               if "\ufffd" not in visible[i:i + 2]), None)
  if stop is None:
    pytest.skip("the completion has no text to stop at")
  cut = api.completions.create(stop=[stop, "never there"], **base)
  assert cut.choices[0].text == full[:full.find(stop)]
  assert cut.choices[0].finish_reason == "stop"
  assert ids_of(cut.choices[0]) == ids_of(whole.choices[0])  # the ids are the completion's
  cut_streamed = list(api.completions.create(stop=stop, stream=True, **base))
  assert "".join(c.choices[0].text for c in cut_streamed) == cut.choices[0].text
  assert cut_streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_canvas_events_only_when_asked(server):
  body = {"model": "dream", "prompt": "Hi", "max_tokens": 6, "seed": 1, "stream": True,
          **KNOBS}
  plain = httpx.post(server.base_url + "/completions", json=body, timeout=60).text
  assert "event: canvas" not in plain and plain.endswith("data: [DONE]\n\n")
  text = httpx.post(server.base_url + "/completions", json={**body, "mdjax_canvas": True},
                    timeout=60).text
  events = [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n")
            if block.startswith("event: canvas")]
  assert [e["step"] for e in events] == list(range(1, KNOBS["steps"] + 1))
  assert all(len(e["tokens"]) == 6 and e["num_steps"] == 4 for e in events)
  assert all(t is not None for t in events[-1]["tokens"])
  masked = [sum(t is None for t in e["tokens"]) for e in events]
  assert masked == sorted(masked, reverse=True)
  for e in events:  # a sampler that never rewrites: every written token is final
    assert e["final"] == [t is not None for t in e["tokens"]]
    assert e["committed"] == (e["final"] + [False]).index(False)


def canvas_events(server, body) -> list[dict]:
  text = httpx.post(server.base_url + "/completions", json={**body, "mdjax_canvas": True},
                    timeout=60).text
  return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n")
          if block.startswith("event: canvas")]


@pytest.mark.slow
def test_a_rewriting_samplers_tokens_are_provisional_until_its_row_finishes(server):
  body = {"model": "dream", "prompt": "Hi", "max_tokens": 6, "seed": 1, "stream": True,
          "sampler": "remask", "steps": 4, "eta": 0.5, "temperature": 1.0}
  events = canvas_events(server, body)
  assert [e["step"] for e in events] == [1, 2, 3, 4]
  written = [sum(t is not None for t in e["tokens"]) for e in events]
  assert written[0] > 0  # provisional tokens exist before the end
  for e in events[:-1]:
    assert not any(e["final"]) and e["committed"] == 0
  assert all(events[-1]["final"]) and events[-1]["committed"] == 6


@pytest.mark.slow
def test_concurrent_mixed_requests_each_equal_offline(server):
  model = server.model
  cases = [  # two specs, two prompt lengths, n of 1 and 2, streamed or not, text or chat
      dict(kind="text", prompt="Hello", max_tokens=8, seed=1, n=1, knobs=KNOBS),
      dict(kind="chat", prompt="Hi", max_tokens=8, seed=2, n=2, knobs=KNOBS),
      dict(kind="text", prompt="World", max_tokens=8, seed=3, n=1,
           knobs={"steps": 2, "temperature": 1.0}),
      dict(kind="stream", prompt="Hello", max_tokens=8, seed=4, n=1, knobs=KNOBS),
      dict(kind="text", prompt="abcde", max_tokens=8, seed=5, n=2, knobs=KNOBS),
      dict(kind="chat", prompt="Yo", max_tokens=8, seed=6, n=1, knobs=KNOBS),
      dict(kind="stream", prompt="Hello", max_tokens=8, seed=7, n=2, knobs=KNOBS),
      dict(kind="text", prompt="Hello", max_tokens=8, seed=8, n=1, knobs=KNOBS),
  ]
  api = client(server)

  def send(case):
    common = dict(model="dream", max_tokens=case["max_tokens"], seed=case["seed"],
                  n=case["n"], extra_body=case["knobs"])
    if case["kind"] == "chat":
      out = api.chat.completions.create(messages=[{"role": "user", "content": case["prompt"]}],
                                        **common)
      return [ids_of(c) for c in out.choices]
    if case["kind"] == "stream":
      ids = {}
      for chunk in api.completions.create(prompt=case["prompt"], stream=True, **common):
        for c in chunk.choices:
          if c.finish_reason:
            ids[c.index] = ids_of(c)
      return [ids[i] for i in range(case["n"])]
    out = api.completions.create(prompt=case["prompt"], **common)
    return [ids_of(c) for c in out.choices]

  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
    served = list(pool.map(send, cases))
  for case, got in zip(cases, served):
    prompt = (chat_ids(model, [{"role": "user", "content": case["prompt"]}])
              if case["kind"] == "chat" else model.encode(case["prompt"]))
    _, expected = offline(server, prompt, max_tokens=case["max_tokens"], seed=case["seed"],
                          n=case["n"], knobs=case["knobs"])
    assert got == [c.token_ids.tolist() for c in expected], case


BAD = [
    ("completions", b'{"prompt": "Hi", "max_tokens": 4', None),
    ("completions", [1, 2], None),
    ("completions", {"prompt": 3}, "prompt"),
    ("completions", {"prompt": ["a", "b"], "n": 3}, "prompt"),  # 6 rows: past max_batch
    ("completions", {"prompt": ["a", 3]}, "prompt"),
    ("completions", {"prompt": [1, 2, 1000]}, "prompt"),
    ("completions", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 4097}, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": 95}, "max_tokens"),
    ("completions", {"prompt": "x" * 100, "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "Hi", "sampler": "nope"}, "sampler"),
    ("completions", {"prompt": "Hi", "sampler": 3}, "sampler"),
    ("completions", {"prompt": "Hi", "frobnicate": 1}, "frobnicate"),
    ("completions", {"prompt": "Hi", "threshold": 0.9}, "threshold"),
    ("completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "Hi", "steps": 0}, "steps"),
    ("completions", {"prompt": "Hi", "n": 5}, "n"),
    ("completions", {"prompt": "Hi", "n": 0}, "n"),
    ("completions", {"prompt": "Hi", "seed": -1}, "seed"),
    ("completions", {"prompt": "Hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "Hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "Hi", "logprobs": 3}, "logprobs"),
    ("completions", {"prompt": "Hi", "sampler": "local_remask", "max_tokens": 8}, "sampler"),
    ("chat/completions", {"messages": "Hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("chat/completions", {"prompt": "Hi"}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
]


@pytest.mark.slow
def test_bad_requests_get_400_naming_the_field(server):
  for route, body, param in BAD:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.base_url}/{route}", content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, (body, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == param, (body, error)
    assert error["message"]
    if param is not None and param not in ("prompt", "messages"):
      assert param in error["message"], error
  assert httpx.get(server.url + "/health").json()["status"] == "ok"
  # The openai client sees the same as BadRequestError; the server serves on.
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client(server).completions.create(model="dream", prompt="Hi", max_tokens=4,
                                      temperature=-0.5)
  out = client(server).completions.create(model="dream", prompt="Hi", max_tokens=4, seed=0,
                                          extra_body=KNOBS)
  assert out.choices[0].finish_reason in ("stop", "length")


def test_models_health_and_metrics(server):
  api = client(server)
  assert [m.id for m in api.models.list().data] == ["dream"]
  assert httpx.get(server.url + "/health").status_code == 200
  api.completions.create(model="dream", prompt="Hi", max_tokens=4, seed=0, extra_body=KNOBS)
  response = httpx.get(server.url + "/metrics")
  assert response.status_code == 200
  assert response.headers["content-type"].startswith("text/plain")
  samples, types = {}, {}
  for line in response.text.splitlines():
    if line.startswith("# TYPE"):
      _, _, name, kind = line.split()
      types[name] = kind
      continue
    if line.startswith("#") or not line:
      continue
    match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)', line)
    assert match, line
    samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
  for name in ("mdjax_queue_rows", "mdjax_active_rows", "mdjax_slots", "mdjax_ticks_total",
               "mdjax_denoiser_calls_total", "mdjax_completion_tokens_total",
               "mdjax_tokens_per_second", "mdjax_compiles_total"):
    assert name in samples and name in types, name
  assert samples["mdjax_ticks_total"] > 0 and samples["mdjax_completion_tokens_total"] > 0
  # Every tick ran one bucket of slots: the counts by bucket add up to the ticks.
  assert types["mdjax_bucket_ticks_total"] == "counter"
  assert samples["mdjax_ticks_total"] == sum(
      v for k, v in samples.items() if k.startswith("mdjax_bucket_ticks_total{bucket="))
  assert samples['mdjax_requests_total{status="200"}'] >= 1
  assert types["mdjax_request_latency_seconds"] == "histogram"
  buckets = [v for k, v in samples.items()
             if k.startswith("mdjax_request_latency_seconds_bucket")]
  assert buckets == sorted(buckets)
  assert buckets[-1] == samples["mdjax_request_latency_seconds_count"]
  assert samples["mdjax_request_latency_seconds_count"] == sum(
      v for k, v in samples.items() if k.startswith("mdjax_requests_total"))
  assert httpx.get(server.url + "/v1/nowhere").json()["error"]["type"] == "invalid_request_error"


def test_api_key(dream_model):
  with running_server(dream_model, api_key="sesame", max_batch=2, start=False) as server:
    with pytest.raises(openai.AuthenticationError):
      client(server, api_key="wrong").models.list()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
      response = httpx.post(server.base_url + "/completions", json={"prompt": "Hi"},
                            headers=headers)
      assert response.status_code == 401
      assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # open
    assert [m.id for m in client(server, api_key="sesame").models.list().data] == ["dream"]


def test_full_queue_gets_429_and_a_client_that_leaves_cancels(dream_model):
  """An engine that does not tick (not started): one slot and one place in the queue hold two
  requests; the third gets 429 with Retry-After. Clients that leave cancel their jobs."""
  with running_server(dream_model, max_batch=1, max_queue=1, start=False) as server:
    handles = []
    submit = server.engine.submit
    server.engine.submit = lambda job, on_update, **kw: handles.append(
        submit(job, on_update, **kw)) or handles[-1]
    body = {"model": "dream", "prompt": "Hi", "max_tokens": 4, "stream": True, **KNOBS}
    with httpx.Client(timeout=30) as http:
      with http.stream("POST", server.base_url + "/completions", json=body) as first:
        assert first.status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # not streamed: waits for a slot
          http.post(server.base_url + "/completions", json={**body, "stream": False},
                    timeout=0.5)
        with pytest.raises(openai.RateLimitError) as caught:
          client(server).completions.create(model="dream", prompt="Hi", max_tokens=4)
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert caught.value.body["code"] == "queue_full"
        assert len(handles) == 2
    deadline = time.monotonic() + 10
    while not all(h.cancelled for h in handles) and time.monotonic() < deadline:
      time.sleep(0.02)
    assert [h.cancelled for h in handles] == [True, True]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'mdjax_requests_total{status="429"} 1' in metrics


@pytest.mark.slow
def test_python_m_serve_finishes_its_request_on_sigterm(tmp_path):
  """The command line on a mesh of two devices: its ready line, one-line usage errors, and
  SIGTERM mid-request: the request completes, the process exits 0."""
  # Two simulated CPU devices: the server runs on a mesh of them (--devices=2).
  env = cpu_devices_env(2)
  bad = subprocess.run([sys.executable, "-m", "mdjax.serve", "--model", DREAM, "--devices=3"],
                       capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
  assert bad.returncode == 2 and bad.stderr.startswith(
      "mdjax.serve: error: --devices=3 is invalid: it must be in [1, 2]"), bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1
  process = subprocess.Popen(
      [sys.executable, "-m", "mdjax.serve", "--model", DREAM, "--port=0", "--canvas_length=96",
       "--max_batch=4", "--steps=8", "--temperature=1.0", "--log_level=warning",
       "--served_model_name=tiny", "--devices=2", "--max_steps=16"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
  try:
    line = process.stdout.readline()
    assert line.startswith("serving tiny on http://127.0.0.1:"), (line, process.stderr.read()
                                                                   if not line else "")
    assert "max_steps=16, prefix_cache_bytes=0, allowed_hosts=127.0.0.1,localhost,[::1]" in line, line
    assert "max_programs=8, max_lane_bytes=none, new_programs=compile" in line, line
    url = re.search(r"http://\S+", line).group(0)
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = api.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                  "content": "Hi"}],
                                         max_tokens=8, seed=3, stream=True)
    chunks = [next(stream)]  # the request is in flight (its first chunk came)
    process.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert process.wait(timeout=60) == 0
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


def test_an_unknown_model_is_a_404_and_an_absent_one_is_the_served_one(server):
  """`"model": "nope"` was answered (200) by the model served. Now it is OpenAI's 404,
  model_not_found naming the field; the served id and an absent `model` are served."""
  api = client(server)
  for call in (lambda: api.completions.create(model="nope", prompt="Hi", max_tokens=4),
               lambda: api.chat.completions.create(
                   model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)):
    with pytest.raises(openai.NotFoundError) as caught:
      call()
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert "'nope' is not served here; this server serves 'dream'" in caught.value.message
  with pytest.raises(openai.NotFoundError):
    api.models.retrieve("nope")
  assert api.models.retrieve("dream").id == "dream"
  out = api.completions.create(model="dream", prompt="Hi", max_tokens=4, seed=0,
                               extra_body=KNOBS)
  absent = httpx.post(server.base_url + "/completions", timeout=60, json={
      "prompt": "Hi", "max_tokens": 4, "seed": 0, **KNOBS})
  assert absent.status_code == 200 and absent.json()["model"] == "dream"
  assert absent.json()["choices"][0]["text"] == out.choices[0].text
  # What the live page reads: the room a request's prompt and max_tokens share, and what the
  # model takes (the Dream fixture: text and a chat template).
  card = api.models.list().data[0].model_extra
  assert card["max_model_len"] == server.engine.room
  assert card["mdjax"]["text_prompts"] is True and card["mdjax"]["chat_template"] is True
  assert card["mdjax"]["vocab_size"] == server.model.vocab_size
  assert card["mdjax"]["mask_id"] == server.model.mask_id
